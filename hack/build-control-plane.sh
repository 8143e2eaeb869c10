#!/usr/bin/env bash
# Builds kube-apiserver, kubectl and etcd from the pinned Go tools modules in tools/
# into a cache folder outside the repo, keyed by version and go.sum hash.
# Prints the bin folder on stdout. Reuses the cache when it is complete.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${REFIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/refit}

die() { echo "build-control-plane: $*" >&2; exit 1; }
command -v go >/dev/null 2>&1 || die "the Go toolchain (go >= 1.26) is not on PATH; install it from https://go.dev/dl and retry"

kube_version=$(cd "$root/tools/kube" && go list -m -f "{{.Version}}" k8s.io/kubernetes)
etcd_version=$(cd "$root/tools/etcd" && go list -m -f "{{.Version}}" go.etcd.io/etcd/server/v3)
[ -n "$kube_version" ] || die "cannot read the k8s.io/kubernetes version from tools/kube/go.mod"
[ -n "$etcd_version" ] || die "cannot read the etcd version from tools/etcd/go.mod"
key=$(cat "$root/tools/kube/go.sum" "$root/tools/etcd/go.sum" | sha256sum | cut -c1-12)
bin="$cache/bin/kube-$kube_version-etcd-$etcd_version-$key"

if [ -x "$bin/kube-apiserver" ] && [ -x "$bin/kubectl" ] && [ -x "$bin/etcd" ]; then
  echo "$bin"; exit 0
fi
# One build at a time: a second run (another terminal, a test's set-up) waits, then reuses it.
mkdir -p "$cache/bin"
exec 9>"$cache/bin/.build.lock"
flock 9
if [ -x "$bin/kube-apiserver" ] && [ -x "$bin/kubectl" ] && [ -x "$bin/etcd" ]; then
  echo "$bin"; exit 0
fi
rm -rf "$bin.partial"
mkdir -p "$bin.partial"
log="$cache/build-$key.log"
echo "build-control-plane: building kube-apiserver/kubectl $kube_version and etcd $etcd_version (cold build: 10-20 min on 2 cores; log: $log)" >&2
minor=$(echo "$kube_version" | cut -d. -f2)
major=$(echo "$kube_version" | cut -d. -f1 | tr -d v)
now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
ldf=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldf="$ldf -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean -X $pkg.buildDate=$now"
done
# A first build is minutes of silence otherwise: say how long it has been running.
started=$SECONDS
( while sleep 30; do
    echo "build-control-plane: still building ($((SECONDS - started)) s so far; first time only, then cached in $cache/bin)" >&2
  done ) &
ticker=$!
trap 'kill $ticker 2>/dev/null' EXIT
(
  cd "$root/tools/kube"
  CGO_ENABLED=0 go build -trimpath -ldflags "$ldf" -o "$bin.partial/" k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kubectl
  cd "$root/tools/etcd"
  CGO_ENABLED=0 go build -trimpath -o "$bin.partial/etcd" go.etcd.io/etcd/server/v3
) >"$log" 2>&1 || { tail -20 "$log" >&2; die "go build failed (full log: $log)"; }
rm -rf "$bin"; mv "$bin.partial" "$bin"
echo "build-control-plane: built in $((SECONDS - started)) s: $bin" >&2
echo "$bin"
