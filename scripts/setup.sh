#!/usr/bin/env bash
# Sets up osworld_jax on a fresh Debian machine: system packages, then a virtualenv in .venv with
# the package, the analysis tools the run's printed commands use (the [analysis] extra:
# TensorBoard, the notebook runner) and (with --dev) its test tools. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=0
APPS=0
for a in "$@"; do
  case "$a" in
    --dev) DEV=1 ;;
    --apps) APPS=1 ;;
    *) echo "setup.sh: unknown argument $a" >&2; exit 2 ;;
  esac
done

# --- system packages (Debian) -------------------------------------------------------------
# Exactly what the jailed `local` desktop sandbox needs (osworld_jax/env/local; its preflight()
# checks them): bubblewrap (the jail), xvfb + openbox (display, window manager), dbus (session bus,
# dbus-run-session), at-spi2-core (a11y bus), xdotool (the pyautogui shim's input), wmctrl
# (window activate/close/open-wait), python3-xlib + python3-pyatspi (the in-jail server, run by
# the system python3: screenshots, a11y tree), mousepad (the text editor of the bundled tasks).
APT_PACKAGES=(
  bubblewrap xvfb openbox dbus at-spi2-core xdotool wmctrl
  python3 python3-xlib python3-pyatspi mousepad
)
# --apps: the desktop applications of the OSWorld tasks, run inside the same jail
# (osworld_jax/env/local/apps.py lists them and how each is set up there): LibreOffice Calc,
# Writer, Impress (+ the GTK3 plugin for the accessibility tree, python3-uno), Chromium standing
# in for google-chrome, GIMP 2.10, VLC, Thunderbird, socat (the tasks forward Chrome's DevTools
# port with it), GNOME Terminal, xdg-utils, desktop-file-utils, PulseAudio. VS Code is not in
# Debian. About 400 MB to download, 1.4 GB installed.
if [ "$APPS" -eq 1 ]; then
  APT_PACKAGES+=(
    libreoffice-calc libreoffice-writer libreoffice-impress libreoffice-gtk3 python3-uno
    chromium gimp gtk2-engines-pixbuf vlc thunderbird socat gnome-terminal
    xdg-utils desktop-file-utils pulseaudio pulseaudio-utils
  )
fi
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup.sh: installing system packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- Python environment -------------------------------------------------------------------
PY=${PYTHON:-python3}
# setuptools' "Editable installation" notice (relayed by pip as a BuildBackendWarning banner) is
# information, not a problem: keep it off the set-up's output.
export PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Editable installation"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# --no-compile: pip would byte-compile every module of torch, transformers and jax (tens of
# thousands of files; most of a fresh set-up's CPU time); Python compiles the ones used on import.
if [ "$DEV" -eq 1 ]; then
  .venv/bin/python -m pip install -q --no-compile -e ".[dev,analysis]" 2>&1 | grep -v "is ignored" || true
  # Upstream OSWorld's own controllers (desktop_env/controllers/python.py) drive the local
  # sandbox in tests/env/local/test_upstream_client.py: the wheel is kept, not installed.
  UPSTREAM=.venv/share/osworld-upstream
  ls "$UPSTREAM"/desktop_env-1.0.2-*.whl >/dev/null 2>&1 || \
    .venv/bin/python -m pip download -q --no-deps desktop-env==1.0.2 -d "$UPSTREAM" 2>&1 \
      | grep -v "is ignored" || true
else
  # [analysis]: what the run's printed commands need (tensorboard, scripts/analyze.py, jupyter
  # execute), a few small wheels beside jax's.
  .venv/bin/python -m pip install -q --no-compile -e ".[analysis]" 2>&1 | grep -v "is ignored" || true
fi
.venv/bin/python -c "import osworld_jax, jax; print('osworld_jax ready: jax', jax.__version__)"
[ -x .venv/bin/tensorboard ] && [ -x .venv/bin/jupyter-execute ] || {
  echo "setup.sh: the analysis tools did not install (.venv/bin/tensorboard, jupyter-execute)" >&2
  exit 1
}
