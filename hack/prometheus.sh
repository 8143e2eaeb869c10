#!/usr/bin/env bash
# Installs Prometheus and promtool from Debian's `prometheus` package into a cache folder
# outside the repo (no root install, nothing started). Prints the folder holding both binaries.
# Reuses the cache when it holds the candidate version already.
set -euo pipefail
cache=${REFIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/refit}

die() { echo "prometheus.sh: $*" >&2; exit 1; }
command -v apt-get >/dev/null 2>&1 || die "needs apt-get and dpkg (Debian/Ubuntu) to fetch the prometheus package"

candidate() { apt-cache policy prometheus 2>/dev/null | awk '/Candidate:/ {print $2}'; }
version=$(candidate)
if [ -z "$version" ] || [ "$version" = "(none)" ]; then
  apt-get update -qq >/dev/null 2>&1 || die "apt-get update failed (run it as root, with access to a Debian mirror)"
  version=$(candidate)
fi
[ -n "$version" ] && [ "$version" != "(none)" ] || die "no 'prometheus' package is known to apt on this machine"

dir="$cache/prometheus-${version//[^A-Za-z0-9._+-]/_}"
if [ -x "$dir/prometheus" ] && [ -x "$dir/promtool" ]; then
  echo "$dir"; exit 0
fi
mkdir -p "$cache"
if command -v flock >/dev/null 2>&1; then
  exec 9>"$cache/prometheus.lock"
  flock 9  # another test session may be installing the same version right now
fi
if [ -x "$dir/prometheus" ] && [ -x "$dir/promtool" ]; then
  echo "$dir"; exit 0
fi
work=$(mktemp -d "$cache/prometheus-download.XXXXXX")
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download "prometheus=$version" >download.log 2>&1) \
  || (apt-get update -qq >/dev/null 2>&1 && cd "$work" && apt-get download "prometheus=$version" >download.log 2>&1) \
  || die "apt-get download prometheus=$version failed: $(tail -1 "$work/download.log" 2>/dev/null)"
dpkg -x "$work"/prometheus_*.deb "$work/root" || die "dpkg -x of the prometheus package failed"
for b in prometheus promtool; do
  [ -x "$work/root/usr/bin/$b" ] || die "the prometheus package holds no usr/bin/$b"
done
rm -rf "$dir.partial" && mkdir -p "$dir.partial"
mv "$work/root/usr/bin/prometheus" "$work/root/usr/bin/promtool" "$dir.partial/"
rm -rf "$dir" && mv "$dir.partial" "$dir"
echo "$dir"
