"""The demo's flags, each tested where its effect shows without vLLM: the parsing, the outcome
check (`--grpo-steps 0` ends with the scenario's base weights, not the adapter's version), what
`--keep` prints, where `--out` puts the reports. Every flag the README and docs/ name must be
one of these (tests/e2e/test_demo.py runs the demo itself, with its defaults)."""

from __future__ import annotations

import re
import tempfile
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import pytest
from refit_operator.tools import client as client_module
from refit_operator.tools.refit_document import build_refit

from demo import __main__ as demo
from demo.grpo import GrpoRun

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Each flag of the demo, and the test below that covers it.
COVERED = {
    "--help": "test_help_prints_the_scenario_as_written",
    "--pods": "test_pods_is_bounded",
    "--out": "test_out_is_where_the_reports_go",
    "--grpo-steps": "test_grpo_steps_zero_ends_with_the_scenarios_base_weights",
    "--keep": "test_keep_prints_the_fleet_a_trainer_needs",
}


def documented_flags() -> dict[str, set[str]]:
    """Flags written in backticks in a paragraph that runs the demo (`make demo`,
    `python -m demo`), per file."""
    found: dict[str, set[str]] = {}
    for path in DOCS:
        for paragraph in re.split(r"\n\s*\n", path.read_text()):
            if not re.search(r"make demo|-m demo", paragraph):
                continue
            for span in re.findall(r"`([^`]*)`", paragraph):
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", span):
                    found.setdefault(flag, set()).add(path.name)
    return found


def test_every_flag_the_docs_name_is_the_demos_and_tested() -> None:
    documented = documented_flags()
    assert {"--grpo-steps", "--out", "--keep"} <= set(documented), documented  # README's
    options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", demo.arg_parser().format_help()))
    assert set(documented) <= options, f"not the demo's: {set(documented) - options}"
    assert options == set(COVERED), "a demo flag without its test in COVERED"
    for test in COVERED.values():
        assert callable(globals().get(test)), test


def test_defaults() -> None:
    args = demo.parse_args([])
    assert (args.pods, args.grpo_steps, args.keep) == (3, 8, False)
    assert args.out == str(Path(tempfile.gettempdir()) / "refit-demo")


def test_help_prints_the_scenario_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        demo.parse_args(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    # The docstring's table keeps its lines (not reflowed into one paragraph).
    assert "\n    v1  checkpoint A      AllAtOnce" in text
    for flag in COVERED:
        assert flag in text


def test_pods_is_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.parse_args(["--pods", "1"]).pods == 1
    for bad in ("0", "9"):
        with pytest.raises(SystemExit) as exit_:
            demo.parse_args(["--pods", bad])
        assert exit_.value.code == 2
        assert "--pods must be between 1 and 8" in capsys.readouterr().err


# --------------------------------------------------------------------------- --grpo-steps
def _results(phases: dict[str, str] | None = None) -> list[demo.Result]:
    """The scenario's results as they end when all goes well (or with these phases)."""
    out = []
    for step in demo.SCENARIO:
        r = demo.Result(step, phase=(phases or {}).get(step.name, step.expect))
        if step.expect == "RolledBack":
            r.pod_reasons = {"LogprobDrift"}
        out.append(r)
    return out


SCRAPED = {"probe fail": 1.0, "refit rolled_back": 1.0}
TRAFFIC = {"rollout-0": True, "rollout-1": True, "rollout-2": True}


def _served(version: str) -> dict[str, str]:
    return {f"127.0.0.{11 + i}": version for i in range(3)}


def _grpo_run(steps: int) -> GrpoRun:
    run = GrpoRun(steps=steps, log=Path("trainer.log"), returncode=0)
    run.doc = {
        "end": {"phase": "Succeeded"},
        "records": [{"version": v} for v in run.versions],
        "steps": {str(s): {"versions": [v]} for s, v in enumerate(run.versions[:-1])},
    }
    return run


def test_grpo_steps_zero_ends_with_the_scenarios_base_weights() -> None:
    assert demo.parse_args(["--grpo-steps", "0"]).grpo_steps == 0
    assert demo.parse_args(["--grpo-steps", "20"]).grpo_steps == 20
    # The adapter step is the scenario's last, but it loads beside the base weights: the pods'
    # weight version stays the last base step's (v4).
    assert demo.SCENARIO[-1].adapter and demo.base_version() == "v4"
    assert demo.problems(_results(), None, _served("v4"), TRAFFIC, SCRAPED) == []
    (wrong,) = demo.problems(_results(), None, _served("lora-v1"), TRAFFIC, SCRAPED)
    assert wrong.startswith("every pod should serve v4: 127.0.0.11 serves lora-v1")


def test_with_a_grpo_run_the_pods_end_at_its_last_step() -> None:
    run = _grpo_run(2)
    assert demo.problems(_results(), run, _served("demo-grpo-step-2"), TRAFFIC, SCRAPED) == []
    assert demo.problems(_results(), run, _served("v4"), TRAFFIC, SCRAPED) == [
        "every pod should serve demo-grpo-step-2: "
        "127.0.0.11 serves v4, 127.0.0.12 serves v4, 127.0.0.13 serves v4"
    ]


def test_grpo_steps_must_not_be_negative(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        demo.parse_args(["--grpo-steps", "-1"])
    assert exit_.value.code == 2
    assert "--grpo-steps must be 0 or more" in capsys.readouterr().err


def test_base_version_skips_adapters_and_rollbacks() -> None:
    v2, v3 = demo.SCENARIO[1], demo.SCENARIO[2]
    lora = demo.SCENARIO[-1]
    assert v3.expect == "RolledBack"
    assert demo.base_version((v2, v3, lora)) == "v2"


def test_each_problem_is_named() -> None:
    results = _results({"demo-v2": "Failed"})
    results[2].pod_reasons = {"ProbeTimeout"}
    got = demo.problems(
        results, None, _served("v4"), {**TRAFFIC, "rollout-1": False}, {"probe fail": 1.0}
    )
    assert got == [
        "demo-v2 ended Failed, not Succeeded",
        "pods out of traffic at the end: rollout-1",
        "Prometheus scraped no rolled-back refit from the operator",
        "demo-v3: no pod's probe reported LogprobDrift or NllDrift",
    ]
    failed_run = _grpo_run(1)
    failed_run.returncode = 1
    assert "the GRPO run did not go as expected" in " ".join(
        demo.problems(_results(), failed_run, _served("demo-grpo-step-1"), TRAFFIC, SCRAPED)
    )


# --------------------------------------------------------------------------------- --keep
class _Model:
    allowed_root = Path("/cache/models/tiny/checkpoints")
    checkpoints: ClassVar = {"A": allowed_root / "A", "B": allowed_root / "B"}


class _Client:
    """RefitClient as the printed snippet uses it: each submit builds the document the real
    client would create."""

    made: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, *, namespace: str, kubeconfig: str) -> None:
        self.namespace, self.kubeconfig = namespace, kubeconfig

    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def submit(self, checkpoint_dir: str, version: str, **spec: Any) -> str:
        self.made.append(build_refit("mine", checkpoint_dir, version, **spec))
        return "mine"

    def wait(self, name: str, timeout: float) -> dict[str, Any]:
        return {"phase": "Succeeded"}


def test_keep_prints_the_fleet_a_trainer_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert demo.parse_args(["--keep"]).keep is True
    text = demo.keep_text(
        kubeconfig=Path("/tmp/refit-demo-x/kubeconfig"), kubectl=Path("/bin/kubectl"),
        port=41234, metrics_port=41000, prom_url="http://127.0.0.1:9090",
        state=Path("/tmp/refit-demo-x"), model=_Model(),
    )  # fmt: skip
    assert "export KUBECONFIG=/tmp/refit-demo-x/kubeconfig" in text
    assert "selector app=demo-rollout, vLLM port 41234" in text
    assert "Secret vllm-admin-token, key token" in text
    assert "namespace:        refit-demo" in text
    assert "/cache/models/tiny/checkpoints" in text
    # The snippet it prints runs as written and makes a refit of that fleet with its Secret.
    snippet = text.split("from Python", 1)[1].split("\n", 1)[1].split("Press Ctrl-C")[0]
    monkeypatch.setattr(client_module, "RefitClient", _Client)
    _Client.made.clear()
    exec(textwrap.dedent(snippet), {})
    (doc,) = _Client.made
    fleet = doc["spec"]["fleet"]
    assert fleet["selector"]["matchLabels"] == {"app": "demo-rollout"}
    assert fleet["port"] == 41234
    assert fleet["adminTokenSecretRef"]["name"] == "vllm-admin-token"
    assert doc["spec"]["checkpoint"]["path"] == "/cache/models/tiny/checkpoints/B"


# ---------------------------------------------------------------------------------- --out
class _Refits:
    def __init__(self, docs: dict[str, dict[str, Any]]) -> None:
        self.docs = docs

    def get(self, name: str) -> dict[str, Any]:
        return self.docs[name]


def test_out_is_where_the_reports_go(tmp_path: Path) -> None:
    out = tmp_path / "reports"
    assert demo.parse_args(["--out", str(out)]).out == str(out)
    pod: dict[str, Any] = {
        "name": "rollout-0", "phase": "Succeeded", "startTime": "2026-11-29T08:00:01Z",
        "completionTime": "2026-11-29T08:00:04Z", "stepSeconds": {"load": 2.0},
        "probe": {"verdict": "Pass", "nll": 2.3, "referenceNll": 2.3, "tokens": 64},
    }  # fmt: skip
    failed = {**pod, "phase": "Failed", "reason": "LogprobDrift",
              "probe": {**pod["probe"], "verdict": "Fail", "maxAbsLogprobDiff": 3.0}}  # fmt: skip
    v1, v3 = demo.SCENARIO[0], demo.SCENARIO[2]
    docs = {
        step.name: {"metadata": {"name": step.name, "namespace": demo.NAMESPACE},
                    "spec": {"checkpoint": {"version": step.version}},
                    "status": {"phase": step.expect, "pods": [pod]}}
        for step in (v1, v3)
    }  # fmt: skip
    results = [demo.Result(v1, phase="Succeeded"), demo.Result(v3, phase="RolledBack")]
    results[1].rejected = {"phase": "Progressing", "pods": [failed]}
    demo.draw_reports(_Refits(docs), results, out)  # type: ignore[arg-type]
    assert sorted(p.name for p in out.iterdir()) == [
        "demo-v1.png", "demo-v3-rejected.png", "demo-v3.png"
    ]  # fmt: skip
    assert results[1].rejected_report == out / "demo-v3-rejected.png"
