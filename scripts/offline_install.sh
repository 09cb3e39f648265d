#!/usr/bin/env bash
# Installs a bundle of scripts/offline_bundle.sh on the OFFLINE machine, from the repository root:
#   bash scripts/offline_install.sh DIR
# No network, no apt, no dpkg database touched (root is not needed; as root, DIR and its parents
# must be world-searchable: the jails run as an unprivileged uid and read the root).
#   DIR/root: the jail's system root, every deb of DIR/debs unpacked (dpkg-deb -x, or Python when
#     there is no dpkg-deb), /bin /sbin /lib /lib64 merged into /usr (usrmerge), absolute links
#     made relative (so each resolves inside the root from the host too), and what the packages'
#     maintainer scripts would have made: the library cache, the GSettings schemas, the font
#     cache, a machine id. Then every program and library of the root is checked to load only
#     libraries of the root (its own dynamic loader, never the host's).
#   DIR/site: the wheels of DIR/wheels (pip --no-index --no-deps --target).
# It prints the settings a run needs (PYTHONPATH; LocalBackendConfig.system_root, and
# LocalBackendConfig.window_manager when the root's is not openbox).
set -euo pipefail

[ $# -eq 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
DIR=$(cd "$1" && pwd)
ROOT="$DIR/root"
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for p in /opt/torch/.venv/bin/python3 python3; do
    if command -v "$p" >/dev/null 2>&1; then PY=$(command -v "$p"); break; fi
  done
fi
[ -n "$PY" ] || { echo "offline_install.sh: no python3 (set PYTHON=)" >&2; exit 1; }
ls "$DIR"/debs/*.deb >/dev/null 2>&1 || { echo "offline_install.sh: no $DIR/debs/*.deb" >&2; exit 1; }

# --- the root ------------------------------------------------------------------------------
NEW="$DIR/root.new"
rm -rf "$NEW"
mkdir -p "$NEW"
chmod 0755 "$NEW"
if command -v dpkg-deb >/dev/null 2>&1; then
  for deb in "$DIR"/debs/*.deb; do dpkg-deb -x "$deb" "$NEW"; done
else  # a .deb is an ar archive holding data.tar.{xz,gz,zst,}
  "$PY" - "$NEW" "$DIR"/debs/*.deb <<'EOF'
import io, sys, tarfile
root, debs = sys.argv[1], sys.argv[2:]
for deb in debs:
    with open(deb, "rb") as f:
        assert f.read(8) == b"!<arch>\n", deb
        while header := f.read(60):
            name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
            body = f.read(size + size % 2)[:size]
            if name.startswith("data.tar"):
                if name.endswith(".zst"):
                    sys.exit(f"{deb}: zstd data needs dpkg-deb")
                trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "data_filter") else {}
                with tarfile.open(fileobj=io.BytesIO(body)) as tar:
                    tar.extractall(root, **trusted)  # our own debs: links, modes, owners kept
EOF
fi
# usrmerge: Debian 12's debs still ship /bin, /lib, ...; their files move under /usr.
for top in bin sbin lib lib32 lib64 libx32; do
  if [ -d "$NEW/$top" ] && [ ! -L "$NEW/$top" ]; then
    mkdir -p "$NEW/usr/$top"
    cp -a "$NEW/$top/." "$NEW/usr/$top/"
    rm -rf "${NEW:?}/$top"
    ln -s "usr/$top" "$NEW/$top"
  fi
done
# Absolute links (e.g. lib64/ld-linux-x86-64.so.2 -> /lib/x86_64-linux-gnu/...) become relative:
# seen from the host they would point into the host's own /lib.
"$PY" - "$NEW" <<'EOF'
import os, sys
root = sys.argv[1]
for d, dirs, files in os.walk(root):
    for n in dirs + files:
        p = os.path.join(d, n)
        if os.path.islink(p) and (t := os.readlink(p)).startswith("/"):
            os.unlink(p)
            os.symlink(os.path.relpath(root + t, d), p)
EOF
mkdir -p "$NEW/var/lib/dbus" "$NEW/var/cache/fontconfig" "$NEW/tmp" "$NEW/root" "$NEW/home"
for f in passwd group hostname hosts; do  # the jail mounts its own over these
  [ -e "$NEW/etc/$f" ] || : >"$NEW/etc/$f"
done
if [ -x "$NEW/usr/bin/blackbox" ]; then  # its root menu (Debian's menu package writes one)
  mkdir -p "$NEW/etc/X11/blackbox"
  printf '[begin] (Blackbox)\n  [restart] (Restart)\n[end]\n' >"$NEW/etc/X11/blackbox/blackbox-menu"
fi
"$PY" -c "import uuid; print(uuid.uuid4().hex)" >"$NEW/etc/machine-id"
cp "$NEW/etc/machine-id" "$NEW/var/lib/dbus/machine-id"
LD="$NEW/usr/lib64/ld-linux-x86-64.so.2"
LIBS="$NEW/usr/lib/x86_64-linux-gnu"
run() { "$LD" --inhibit-cache --library-path "$LIBS" "$@"; }  # a program of the root, its libs
# What the packages' triggers would have built (the root's loader searches its default
# directories without a library cache; fontconfig scans its fonts without one, slower).
run "$NEW/usr/bin/glib-compile-schemas" "$NEW/usr/share/glib-2.0/schemas"
if [ -x "$NEW/usr/bin/fc-cache" ]; then
  run "$NEW/usr/bin/fc-cache" -s -y "$NEW" >/dev/null 2>&1 || echo "offline_install.sh: fc-cache failed"
fi

# Every program and library of the root loads only the root's libraries. Plugins (in
# subdirectories: image loaders, GIO modules) may miss theirs: they are loaded on demand, and
# those of excluded packages never are.
"$PY" - "$NEW" "$LD" "$LIBS" <<'EOF'
import os, subprocess, sys
root, ld, libs = sys.argv[1:]
bad, n = [], 0
dirs = ["usr/bin", "usr/sbin", "usr/libexec", "usr/lib/x86_64-linux-gnu"]
for d in dirs:
    for dp, _, files in os.walk(os.path.join(root, d)):
        if d.endswith("x86_64-linux-gnu") and dp != os.path.join(root, d):
            continue
        for f in files:
            p = os.path.join(dp, f)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            with open(p, "rb") as fh:
                if fh.read(4) != b"\x7fELF":
                    continue
            out = subprocess.run([ld, "--inhibit-cache", "--library-path", libs, "--list", p],
                                 capture_output=True, text=True)
            if out.returncode != 0 and "statically linked" in out.stdout + out.stderr:
                continue
            n += 1
            for line in out.stdout.splitlines():
                if "=>" in line:
                    target = line.split("=>")[1].split("(")[0].strip()
                    if target == "not found" or not os.path.realpath(target).startswith(root + "/"):
                        bad.append(f"{os.path.relpath(p, root)}: {line.strip()}")
if bad:
    sys.exit("offline_install.sh: libraries not in the root:\n  " + "\n  ".join(bad[:40]))
print(f"offline_install.sh: {n} programs and libraries load only the root's libraries")
EOF
rm -rf "$ROOT"
mv "$NEW" "$ROOT"

# --- the wheels ----------------------------------------------------------------------------
SITE="$DIR/site"
rm -rf "$SITE"
mkdir -p "$SITE"
if ls "$DIR"/wheels/*.whl >/dev/null 2>&1; then
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
      --root-user-action=ignore \
      --target "$SITE" --only-binary=:all: --python-version 3.12 --implementation cp \
      --abi cp312 --abi abi3 --abi none --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
      "$DIR"/wheels/*.whl
  else  # no pip: a wheel is a zip of the site-packages files
    "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
      "$SITE" "$DIR"/wheels/*.whl
  fi
fi

if [ "$(id -u)" -eq 0 ]; then  # the jails (an unprivileged uid) must reach the root
  d="$ROOT"
  while [ "$d" != "/" ]; do
    if [ "$(( $(stat -c %a "$d" | sed 's/^\(.*\)\(.\)$/\2/') & 1 ))" -eq 0 ]; then
      echo "offline_install.sh: WARNING: $d is not searchable by other users: chmod o+x $d"
    fi
    d=$(dirname "$d")
  done
fi
echo "offline_install.sh: root $ROOT ($(du -sm "$ROOT" | cut -f1) MiB), site $SITE"
WM=""  # LocalBackendConfig.window_manager's default is openbox
if [ ! -x "$ROOT/usr/bin/openbox" ]; then
  if [ -x "$ROOT/usr/bin/blackbox" ]; then WM=blackbox
  elif [ -x "$ROOT/usr/bin/evilwm" ]; then WM="evilwm -fn fixed"  # its default font is not in Xvfb
  fi
fi
echo "Use:"
echo "  export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
echo "  --gin_param=\"LocalBackendConfig.system_root = '$ROOT'\""
[ -z "$WM" ] || echo "  --gin_param=\"LocalBackendConfig.window_manager = '$WM'\""
