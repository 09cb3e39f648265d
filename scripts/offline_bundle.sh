#!/usr/bin/env bash
# Builds the folder an OFFLINE machine needs to run the RL loop with the jailed local sandbox
# (docs/SCALE.md, "An offline GPU machine"). Run on a networked Debian bookworm amd64 machine,
# root or not:
#   bash scripts/offline_bundle.sh DIR            # DIR/debs + DIR/wheels, sizes printed
#   bash scripts/offline_bundle.sh --debs-only DIR
# Then copy DIR (and the repository) to the offline machine and run scripts/offline_install.sh.
#
# DIR/debs: the .deb closure of the jail's Debian userland (bubblewrap, Xvfb, a window manager,
# dbus, at-spi, xdotool, wmctrl, Debian's python3.11 + python3-xlib + python3-pyatspi, sh, bash,
# coreutils, tar, prlimit, glibc), resolved by apt against an EMPTY package database so that the
# root it unpacks into is self-contained, minus the packages of EXCLUDE: one fake installed
# package provides them, so apt fetches neither them nor what only they need (offline_install.sh
# checks that every program and library of the root finds all its libraries in the root).
# The window manager is blackbox (EWMH: wmctrl lists, activates and closes windows; 1.7 MB with
# its font): openbox, the default of LocalBackendConfig.window_manager, needs pango, cairo,
# librsvg and libxml2 with ICU (+17 MB: --wm=openbox, ~52 MB of debs alone). Without the --apps
# applications and without mousepad (GTK 3 and GtkSourceView: +25 MB): the bundled text_editor
# tasks need it and are skipped as not runnable, as are the two compare_table tasks (pandas,
# openpyxl: 13.3 MiB of wheels).
# DIR/wheels: the CPython 3.12 manylinux wheels of the Python packages that scripts/train.py
# (configs/gpu_1x_h200.gin: the embedded server, the local sandbox, the evaluators) imports and
# that the GPU image (jax, flax, optax, orbax, chex, torch, transformers, numpy, safetensors,
# tokenizers, jaxtyping, pillow and their dependencies) does not have (WHEELS).
#
# apt runs with its own state (an empty dpkg status, its own lists; ~/.cache/osworld_jax/offline-apt
# or OFFLINE_APT_DIR), so it changes nothing on this machine; debs already in
# /var/cache/apt/archives are copied, not downloaded.
# OFFLINE_APT_LISTS=/var/lib/apt/lists reuses this machine's package lists (no apt-get update).
set -euo pipefail

WHEELS_TOO=1
WM=blackbox
while [ $# -gt 1 ]; do
  case "$1" in
    --debs-only) WHEELS_TOO=0 ;;
    --wm=*) WM=${1#--wm=} ;;
    *) break ;;
  esac
  shift
done
[ $# -eq 1 ] || { echo "usage: $0 [--debs-only] [--wm=PACKAGE] DIR" >&2; exit 2; }
mkdir -p "$1"
DIR=$(cd "$1" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)

# The jail's programs (osworld_jax/env/local/preflight.py REQUIRED_BINARIES, the window manager,
# the in-jail server's python3 and modules) and what the root needs to be self-contained.
PACKAGES=(
  bubblewrap xvfb x11-xkb-utils xkb-data "$WM" dbus-daemon dbus-bin at-spi2-core xdotool wmctrl
  python3-minimal libpython3.11-stdlib python3-xlib python3-pyatspi
  libc6 dash bash coreutils tar util-linux findutils grep sed
  libglib2.0-bin
)
# The window manager's title bars need one font: Bitstream Vera (0.2 MB; DejaVu, its descendant
# and Debian's default, is 1 MB). evilwm (--wm=evilwm) draws no text, but ignores wmctrl -c.
[ "$WM" = evilwm ] || PACKAGES+=(ttf-bitstream-vera)
# Marked as installed, never fetched: nothing in the jail loads them (offline_install.sh checks
# that every program and library of the root finds its libraries in the root).
EXCLUDE=(
  # Mesa's GL drivers and LLVM (~35 MB): Xvfb runs without them (its GLX finds no DRI driver
  # and is left out; no program of the jail uses OpenGL).
  libglx-mesa0 libgl1-mesa-dri libllvm15 libz3-4 mesa-vulkan-drivers
  # imlib2's image loaders' codecs (HEIF, JPEG XL, PostScript, WebP, ...): openbox links imlib2
  # but loads only its own theme's images; gdk-pixbuf's TIFF loader and MIME database
  libheif1 libjxl0.7 libspectre1 libid3tag0 libopenjp2-7 libgs10 libgs10-common
  libwebpdemux2 libgif7 libtiff6 libwebp7 shared-mime-info libgdk-pixbuf2.0-common
  # changelogs and man pages: xserver-common is Xvfb's 2.3 MB changelog and its protocol names;
  # python3.11 the interpreter's NEWS and pydoc (the interpreter is python3.11-minimal)
  xserver-common x11-common python3 python3.11 libpython3-stdlib
  # the system's init, PAM, users, package manager and settings stores: the jail runs none of
  # them (GSettings falls back to its in-memory store)
  systemd systemd-sysv libpam-systemd dbus-user-session dbus dbus-system-bus-common
  dconf-service dconf-gsettings-backend gconf-gsettings-backend adduser passwd procps
  init-system-helpers usrmerge perl perl-base libperl5.36 perl-modules-5.36 dpkg debconf ucf
  sensible-utils lsb-base sysvinit-utils libpam-runtime libpam-modules libpam-modules-bin
  libc-bin util-linux-extra
  # Python 3.11's modules the jail does not import: nis, dbm, readline, curses
  libnsl2 libtirpc3 libdb5.3 libgdbm6 libgdbm-compat4 libreadline8
  readline-common libncursesw6 media-types tzdata
  # GLib's translations; DejaVu (see ttf-bitstream-vera above)
  libglib2.0-data fonts-dejavu-core
)
# The Python packages the GPU image lacks (pip names; the versions tested here). Found by recording
# sys.modules in a CPU run of scripts/train.py (--validate_only with configs/gpu_1x_h200.gin, and
# one step of configs/default.gin: trainer, embedded server, local sandbox, evaluators), minus the
# image's packages and their dependencies.
WHEELS=(
  grain==0.2.18 array-record==0.8.6 cloudpickle==3.1.3 portpicker==1.6.0  # data pipeline
  gin-config==0.5.0 orjson==3.13.0                                       # configs, logs
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0  # the server's HTTP
  frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
  lxml==6.2.0 cssselect==1.6.0                                            # the evaluators
)
# apt's own state (lists ~20 MB) stays out of DIR, which travels.
APTDIR=${OFFLINE_APT_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/osworld_jax/offline-apt}
mkdir -p "$APTDIR/lists/partial" "$DIR/debs/partial"
LISTS=${OFFLINE_APT_LISTS:-$APTDIR/lists}
APT=(apt-get -q -y -o "Dir::State::status=$APTDIR/status" -o "Dir::State::Lists=$LISTS"
  -o "Dir::Cache=$APTDIR" -o "Dir::Cache::archives=$DIR/debs" -o Debug::NoLocking=1
  -o APT::Sandbox::User="$(id -un)" -o APT::Architecture=amd64 -o APT::Architectures=amd64)
APTCACHE=(apt-cache -o "Dir::State::status=$APTDIR/status" -o "Dir::State::Lists=$LISTS"
  -o "Dir::Cache=$APTDIR" -o APT::Architecture=amd64 -o APT::Architectures=amd64)
if [ -z "${OFFLINE_APT_LISTS:-}" ]; then
  : >"$APTDIR/status"
  "${APT[@]}" update >/dev/null
fi
# The excluded packages, provided (at their candidate versions, so that every versioned
# dependency on them holds) by one package marked as installed that depends on nothing.
{ "${APTCACHE[@]}" show --no-all-versions "${EXCLUDE[@]}" 2>/dev/null || true; } \
  | awk '/^Package:/ {p = $2} /^Version:/ {v = $2}
         /^$/ && p {provides = provides (provides ? ", " : "") p " (= " v ")"; p = ""}
         END {
           print "Package: offline-bundle-excluded\nStatus: install ok installed\nVersion: 1"
           print "Architecture: amd64\nMulti-Arch: allowed\nProvides: " provides
           print "Description: what offline_bundle.sh leaves out\n"
         }' >"$APTDIR/status"
# The file names of the closure; those in this machine's apt cache are copied, not downloaded.
mkdir -p "$APTDIR/none/partial"  # an empty archive dir: apt prints only what it would fetch
"${APT[@]}" -o "Dir::Cache::archives=$APTDIR/none" install --no-install-recommends --print-uris \
  "${PACKAGES[@]}" \
  | sed -n "s/^'[^']*' \([^ ]*\) .*/\1/p" | sort >"$APTDIR/closure.txt"
[ -s "$APTDIR/closure.txt" ] || { echo "offline_bundle.sh: apt resolved nothing" >&2; exit 1; }
for f in "$DIR"/debs/*.deb; do  # a previous run's debs outside the closure
  [ -e "$f" ] || continue
  grep -qxF "$(basename "$f")" "$APTDIR/closure.txt" || rm -f "$f"
done
while read -r f; do
  [ -e "$DIR/debs/$f" ] || [ ! -e "/var/cache/apt/archives/$f" ] \
    || cp "/var/cache/apt/archives/$f" "$DIR/debs/$f"
done <"$APTDIR/closure.txt"
"${APT[@]}" install --no-install-recommends --download-only "${PACKAGES[@]}" >/dev/null
rmdir "$DIR/debs/partial" 2>/dev/null || true
rm -f "$DIR/debs/lock"

if [ "$WHEELS_TOO" -eq 1 ]; then
  PY=${PYTHON:-python3}
  mkdir -p "$DIR/wheels"
  rm -f "$DIR"/wheels/*.whl
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DIR/wheels" \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any "${WHEELS[@]}"
fi

mib() { du -cb "$@" 2>/dev/null | tail -1 | awk '{printf "%.1f", $1 / 1048576}'; }
{
  echo "# offline bundle, $(date -u +%Y-%m-%dT%H:%MZ), from $(cd "$REPO" && git rev-parse --short HEAD 2>/dev/null || echo '?')"
  (cd "$DIR/debs" && ls -1 *.deb)
  [ -d "$DIR/wheels" ] && (cd "$DIR/wheels" && ls -1 *.whl 2>/dev/null) || true
} >"$DIR/MANIFEST"
debs=$(mib "$DIR"/debs/*.deb)
wheels=$( [ -d "$DIR/wheels" ] && mib "$DIR"/wheels/*.whl || echo 0)
echo "offline_bundle.sh: $DIR ($(du -sm "$DIR" | cut -f1) MiB): debs $(ls "$DIR"/debs/*.deb | wc -l) files, $debs MiB;" \
  "wheels $(ls "$DIR"/wheels/*.whl 2>/dev/null | wc -l) files, $wheels MiB;" \
  "total $(mib "$DIR"/debs/*.deb "$DIR"/wheels/*.whl) MiB"
