#!/usr/bin/env bash
# Debian tools the test suite and the benchmarks use: promtool (package prometheus) for the metrics format check,
# systemd-analyze (package systemd) for the unit checks and etcd (package etcd-server) for
# cluster mode. Installed when missing and
# possible (root with apt); otherwise the tests that need them skip and say why.
set -uo pipefail
missing=()
command -v promtool >/dev/null || missing+=(prometheus)
command -v systemd-analyze >/dev/null || missing+=(systemd)
command -v etcd >/dev/null || missing+=(etcd-server)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "ensure_tools: cannot install ${missing[*]} (not root or no apt); those tests will skip" >&2
  exit 0
fi
echo "ensure_tools: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
  apt-get update -qq >/dev/null 2>&1 &&
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1; } || {
  echo "ensure_tools: apt-get install ${missing[*]} FAILED" >&2; exit 1; }
