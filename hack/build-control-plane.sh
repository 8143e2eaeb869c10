#!/usr/bin/env bash
# Builds kube-apiserver, kubectl and etcd from the pinned Go tools modules in tools/
# into a cache folder outside the repo, keyed by version and go.sum hash.
# With --node it also builds kubelet, kube-controller-manager and kube-scheduler (the real
# node, testbed/node.py) from the same module, pin and version ldflags, into the same folder.
# Prints the bin folder on stdout. Reuses the cache when it holds what was asked for.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${REFIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/refit}

die() { echo "build-control-plane: $*" >&2; exit 1; }
kube_cmds="kube-apiserver kubectl"
case "${1:-}" in
  "") ;;
  --node) kube_cmds="$kube_cmds kubelet kube-controller-manager kube-scheduler" ;;
  *) die "unknown argument '$1' (usage: build-control-plane.sh [--node])" ;;
esac
command -v go >/dev/null 2>&1 || die "the Go toolchain (go >= 1.26) is not on PATH; install it from https://go.dev/dl and retry"

kube_version=$(cd "$root/tools/kube" && go list -m -f "{{.Version}}" k8s.io/kubernetes)
etcd_version=$(cd "$root/tools/etcd" && go list -m -f "{{.Version}}" go.etcd.io/etcd/server/v3)
[ -n "$kube_version" ] || die "cannot read the k8s.io/kubernetes version from tools/kube/go.mod"
[ -n "$etcd_version" ] || die "cannot read the etcd version from tools/etcd/go.mod"
key=$(cat "$root/tools/kube/go.sum" "$root/tools/etcd/go.sum" | sha256sum | cut -c1-12)
bin="$cache/bin/kube-$kube_version-etcd-$etcd_version-$key"

# What is asked for and not yet built (empty: the cache is complete).
missing() {
  local b
  for b in $kube_cmds etcd; do [ -x "$bin/$b" ] || echo "$b"; done
}
[ -z "$(missing)" ] && { echo "$bin"; exit 0; }
# One build at a time: a second run (another terminal, a test's set-up) waits, then reuses it.
mkdir -p "$cache/bin"
exec 9>"$cache/bin/.build.lock"
flock 9
todo=$(missing | tr '\n' ' ')
[ -z "$todo" ] && { echo "$bin"; exit 0; }
partial="$bin.partial"
rm -rf "$partial"
mkdir -p "$partial"
log="$cache/build-$key.log"
echo "build-control-plane: building $todo(kubernetes $kube_version, etcd $etcd_version; cold build: 10-20 min on 2 cores, kubelet & co. 5-15 min more; log: $log)" >&2
minor=$(echo "$kube_version" | cut -d. -f2)
major=$(echo "$kube_version" | cut -d. -f1 | tr -d v)
now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
ldf=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldf="$ldf -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean -X $pkg.buildDate=$now"
done
pkgs=""
for b in $todo; do [ "$b" = etcd ] || pkgs="$pkgs k8s.io/kubernetes/cmd/$b"; done
# A first build is minutes of silence otherwise: say how long it has been running.
started=$SECONDS
( while sleep 30; do
    echo "build-control-plane: still building ($((SECONDS - started)) s so far; first time only, then cached in $cache/bin)" >&2
  done ) &
ticker=$!
trap 'kill $ticker 2>/dev/null; rm -rf "$partial"' EXIT
(
  if [ -n "$pkgs" ]; then
    cd "$root/tools/kube"
    # shellcheck disable=SC2086 # one package per word
    CGO_ENABLED=0 go build -trimpath -ldflags "$ldf" -o "$partial/" $pkgs
  fi
  case " $todo " in *" etcd "*)
    cd "$root/tools/etcd"
    CGO_ENABLED=0 go build -trimpath -o "$partial/etcd" go.etcd.io/etcd/server/v3 ;;
  esac
) >"$log" 2>&1 || { tail -20 "$log" >&2; die "go build failed (full log: $log)"; }
# Whole binaries only ever appear in $bin: a killed build leaves nothing a reader would use.
mkdir -p "$bin"
for b in $todo; do mv "$partial/$b" "$bin/$b"; done
echo "build-control-plane: built in $((SECONDS - started)) s: $bin" >&2
echo "$bin"
