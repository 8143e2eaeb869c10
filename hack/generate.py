"""`make generate`: every generated or copied file of the repository, from its source.

    python -m hack.generate           # rewrite what is stale, remove what no source makes
    python -m hack.generate --check   # exit 1 naming every stale file; writes nothing

    file                                       made from
    crds/weightrefit.yaml                      the models of operator/refit_operator/core/api.py
                                               (hack/gen_crd.py)
    docs/api-reference.md                      that CRD (hack/gen_api_reference.py)
    monitoring/dashboards/*.json               hack/gen_dashboards.py (grafana-foundation-sdk)
    charts/refit-operator/files/dashboards/    the same dashboards (Helm reads only files
                                               inside the chart, so the chart carries copies)
    charts/refit-operator/crds/*.yaml          copies of crds/*.yaml (weightrefit.yaml as
                                               generated in the same run)
    charts/refit-operator/files/alerts.yaml    a copy of monitoring/alerts.yaml

A file in one of those folders that no source makes is stale too (a renamed dashboard, a
removed CRD). tests/unit/test_generated.py fails when anything is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from hack import gen_api_reference, gen_crd, gen_dashboards

REPO = Path(__file__).resolve().parents[1]
CHART = "charts/refit-operator"
COMMAND = "make generate"
CRD = "crds/weightrefit.yaml"
# Folders whose files of this pattern are all generated: one no source makes is stale.
OWNED = (
    ("monitoring/dashboards", "*.json"),
    (f"{CHART}/files/dashboards", "*.json"),
    (f"{CHART}/crds", "*.yaml"),
)


def expected(root: Path = REPO) -> dict[str, bytes]:
    """Path (relative to root, POSIX) -> the content that file must have, made from the
    sources under root."""
    out: dict[str, bytes] = {}
    weightrefit = gen_crd.render()
    out[CRD] = weightrefit.encode()
    out["docs/api-reference.md"] = gen_api_reference.render(yaml.safe_load(weightrefit)).encode()
    for name, text in gen_dashboards.rendered().items():
        out[f"monitoring/dashboards/{name}"] = text.encode()
        out[f"{CHART}/files/dashboards/{name}"] = text.encode()
    for crd in sorted((root / "crds").glob("*.yaml")):  # any other CRD is copied as it is
        out[f"{CHART}/crds/{crd.name}"] = crd.read_bytes()
    out[f"{CHART}/{CRD}"] = out[CRD]
    out[f"{CHART}/files/alerts.yaml"] = (root / "monitoring" / "alerts.yaml").read_bytes()
    return out


def _strays(root: Path, want: dict[str, bytes]) -> list[str]:
    """Files in the generated folders that no source makes."""
    return [
        rel
        for folder, pattern in OWNED
        for path in sorted((root / folder).glob(pattern))
        if (rel := path.relative_to(root).as_posix()) not in want
    ]


def stale(root: Path = REPO) -> list[str]:
    """Every generated file that is missing, differs from what its source makes, or that no
    source makes; sorted."""
    want = expected(root)
    differ = [
        rel
        for rel, data in want.items()
        if not (root / rel).is_file() or (root / rel).read_bytes() != data
    ]
    return sorted(differ + _strays(root, want))


def generate(root: Path = REPO) -> list[str]:
    """Write every stale file, remove the strays; what changed."""
    want = expected(root)
    changed = stale(root)
    for rel in changed:
        path = root / rel
        if rel in want:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(want[rel])
        else:
            path.unlink()
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hack.generate", description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 naming stale files; write none")
    p.add_argument("--root", type=Path, default=REPO, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.check:
        if found := stale(args.root):
            print(f"stale: {', '.join(found)}; run: {COMMAND}", file=sys.stderr)
            return 1
        return 0
    changed = generate(args.root)
    for rel in changed:
        print(f"{'wrote' if (args.root / rel).exists() else 'removed'} {rel}")
    if not changed:
        print("every generated file is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
