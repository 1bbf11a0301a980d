#!/usr/bin/env bash
# Builds .arm64/: an aarch64 Python 3.11 from Debian's arm64 packages (apt's download verb,
# unpacked with dpkg -x; nothing is installed into the system's dpkg database) plus the
# agent's dependencies as aarch64 wheels from PyPI (--only-binary: a dependency that would
# need compiling on the DPU fails here). Runs under qemu-aarch64 -L; no binfmt handler is
# registered and nothing outside the project's folders changes, except installing the host
# package qemu-user when qemu-aarch64 is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=.arm64
mkdir -p "$ROOT/lists/partial" "$ROOT/debs" "$ROOT/root"
if ! command -v qemu-aarch64 >/dev/null; then
  [ "$(id -u)" = 0 ] || { echo "arm64_env: qemu-aarch64 missing and not root" >&2; exit 1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-user \
    >/dev/null || { echo "arm64_env: apt-get install qemu-user FAILED" >&2; exit 1; }
fi
if [ ! -x "$ROOT/root/usr/bin/python3.11" ]; then
  O=(-oAPT::Architecture=arm64 -oAPT::Architectures=arm64 "-oDir::State::Lists=$PWD/$ROOT/lists"
     -oAPT::Sandbox::User=root -oDir::State::Status=/dev/null -oDebug::NoLocking=1)
  apt-get "${O[@]}" update -qq >/dev/null
  # Python's runtime closure, minus what only a package manager needs (perl, dpkg, tar).
  apt-cache "${O[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts \
      --no-breaks --no-replaces --no-enhances python3.11 libstdc++6 2>/dev/null \
    | grep -v '^[ <]' | sort -u \
    | grep -vxE 'dpkg|install-info|perl|perl-base|perl-modules-5.36|libperl5.36|tar|mailcap|mime-support|libgdbm-compat4' \
    > "$ROOT/packages.txt"
  (cd "$ROOT/debs" && apt-get "${O[@]}" download $(cat ../packages.txt) >/dev/null)
  for deb in "$ROOT"/debs/*.deb; do dpkg -x "$deb" "$ROOT/root"; done
fi
# The agent's dependencies (pyproject's, less what only the host client uses); the stamp
# holds the list, so a change to it reinstalls.
PKGS="numpy grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf
pyzmq safetensors prometheus-client rich scipy numba"
if [ "$(cat "$ROOT/site/.complete" 2>/dev/null)" != "$PKGS" ]; then
  rm -rf "$ROOT/site"
  # shellcheck disable=SC2086
  python3 -m pip install --quiet --only-binary=:all: --no-compile --target "$ROOT/site" \
    --python-version 3.11 --implementation cp --abi cp311 \
    --platform manylinux_2_28_aarch64 --platform manylinux_2_27_aarch64 \
    --platform manylinux_2_26_aarch64 --platform manylinux_2_17_aarch64 \
    --platform manylinux2014_aarch64 --platform any $PKGS
  echo "$PKGS" > "$ROOT/site/.complete"
fi
echo "arm64_env: $(qemu-aarch64 -L "$ROOT/root" "$ROOT/root/usr/bin/python3.11" -c \
  'import platform; print(platform.machine(), platform.python_version())')"
