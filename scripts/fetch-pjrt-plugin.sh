#!/usr/bin/env bash
# Fetches the PJRT CPU plugin (xla-cpu-pjrt 0.0.1 from PyPI), verifies the
# wheel's sha256 and unpacks the plugin library into Ember's cache:
#   ${EMBER_PJRT_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/ember/pjrt}/xla-cpu-pjrt-0.0.1/xla_cpu_pjrt.so
# which is where `ember` looks when neither --pjrt-plugin nor
# EMBER_PJRT_PLUGIN is given. Prints the library's path. Safe to rerun.
set -euo pipefail

VERSION=0.0.1
SHA256=55837b6b7b47daa717f2d9a5a03563ea0ceaa338d06a81a1e2d3f060d960decc
HOME_DIR="${EMBER_PJRT_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/ember/pjrt}"
DEST="$HOME_DIR/xla-cpu-pjrt-$VERSION"
LIB="$DEST/xla_cpu_pjrt.so"

if [[ -f "$LIB" && -f "$DEST/.verified" ]]; then
    echo "$LIB"
    exit 0
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux_2_27_x86_64 --python-version 3 --implementation py \
    -d "$WORK" "xla-cpu-pjrt==$VERSION" >&2
WHEEL="$(ls "$WORK"/xla_cpu_pjrt-*.whl)"
echo "$SHA256  $WHEEL" | sha256sum --check --status || {
    echo "fetch-pjrt-plugin: $WHEEL does not have the pinned sha256 $SHA256" >&2
    exit 1
}
python3 - "$WHEEL" "$WORK/unpacked" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extract("xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so", sys.argv[2])
PY
mkdir -p "$DEST"
# Move into place under a temporary name first, so a partial copy never looks whole.
cp "$WORK/unpacked/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so" "$DEST/.xla_cpu_pjrt.so.tmp"
mv "$DEST/.xla_cpu_pjrt.so.tmp" "$LIB"
touch "$DEST/.verified"
echo "$LIB"
