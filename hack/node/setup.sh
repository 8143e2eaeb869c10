#!/usr/bin/env bash
# Set-up of the real node (tests/node, `python -m testbed.node up`). Everything the node
# downloads happens here, never at test time: Debian packages (apt), containerd 2.x from
# Debian unstable (extracted into the cache, not installed), the Go build of kubelet & co,
# and the images (a Debian root filesystem by mmdebstrap, the operator's Python packages from
# PyPI). Caches live under ~/.cache/refit/node/. Needs root. Idempotent; prints nothing on
# stdout but the cache folder.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cache=${REFIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/refit}
node=$cache/node
die() { echo "node-setup: $*" >&2; exit 1; }
say() { echo "node-setup: $*" >&2; }
[ "$(id -u)" = 0 ] || die "the real node needs root (kubelet, containerd, runc, iptables, mmdebstrap); run as root, or leave tests/node out with: make test REFIT_NODE_TESTS=0"
command -v apt-get >/dev/null || die "needs a Debian-based machine (apt-get)"
mkdir -p "$node"
exec 8>"$node/.setup.lock"
flock 8

# 1. Debian bookworm packages: runc, the CNI plugins, iptables, mmdebstrap (the images).
pkgs="runc containernetworking-plugins iptables mmdebstrap"
missing=""
for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  say "apt-get install$missing"
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >&2
fi

# 2. containerd 2.x: kubelet 1.36 needs the CRI RuntimeConfig call, which bookworm's
# containerd 1.6.20 does not implement. Debian unstable's package is taken with a private apt
# configuration (the machine's sources stay untouched) and only extracted into the cache.
# Its binaries need glibc >= 2.34 (bookworm: 2.36) and run with bookworm's runc.
if [ ! -x "$node/containerd/current/containerd" ]; then
  apt_dir=$node/apt
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$node/containerd"
  echo "deb http://deb.debian.org/debian sid main" >"$apt_dir/sources.list"
  apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
            -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
            -o "Dir::State::status=/dev/null" -o "APT::Architectures::=amd64"
            -o "APT::Sandbox::User=root")
  say "fetching containerd from Debian unstable"
  apt-get "${apt_opts[@]}" update -qq >&2
  work=$(mktemp -d "$node/containerd/.dl.XXXXXX")
  (cd "$work" && apt-get "${apt_opts[@]}" download containerd >&2)
  deb=$(ls "$work"/containerd_*.deb) || die "apt-get download containerd gave no .deb"
  ver=$(dpkg-deb -f "$deb" Version)
  case "$ver" in 2.*) ;; *) die "Debian unstable's containerd is $ver, not 2.x" ;; esac
  dpkg-deb -x "$deb" "$work/x"
  dest=$node/containerd/$ver
  rm -rf "$dest"; mkdir -p "$dest"
  cp -a "$work"/x/usr/bin/. "$dest"/
  rm -rf "$work"
  "$dest/containerd" --version >&2 || die "containerd $ver does not run here"
  ln -sfn "$ver" "$node/containerd/current"
fi

# 3. kubelet, kube-controller-manager, kube-scheduler (and the control plane) from tools/kube.
bash "$root/hack/build-control-plane.sh" --node >/dev/null

# 4. Images (OCI archive), keyed by the operator's sources: rebuilt when they change.
py=$root/.venv/bin/python
[ -x "$py" ] || die "$py missing: run make venv first"
(cd "$root" && "$py" -m testbed.node_images build) >/dev/null
echo "$node"
