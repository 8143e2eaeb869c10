#!/usr/bin/env bash
# Prints the folder holding the Prometheus Operator's CRDs (ServiceMonitor, PrometheusRule, ...)
# so the chart tests can install them into the test API server and send the chart's
# ServiceMonitor and PrometheusRule to it. The CRDs ship in the prometheus-operator Go module
# (example/prometheus-operator-crd/); `go mod download` fetches it once from the Go module
# proxy into the Go module cache, outside the repo.
set -euo pipefail
version=v0.85.0
module=github.com/prometheus-operator/prometheus-operator

die() { echo "prometheus-operator-crds.sh: $*" >&2; exit 1; }
command -v go >/dev/null || die "the Go toolchain is needed (go mod download $module@$version)"

work=$(mktemp -d "${TMPDIR:-/tmp}/refit-po-crds.XXXXXX")
trap 'rm -rf "$work"' EXIT
# Outside any module, so the repo's own go.mod files are not consulted.
(cd "$work" && go mod download -json "$module@$version") >"$work/out.json" \
  2>"$work/err.log" || die "go mod download $module@$version failed: $(tail -3 "$work/err.log")"
dir=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' "$work/out.json")
crds="$dir/example/prometheus-operator-crd"
[ -f "$crds/monitoring.coreos.com_servicemonitors.yaml" ] || die "no CRDs under $crds"
echo "$crds"
