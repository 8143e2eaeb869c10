"""Reload hazards the fleet preflight refuses, and the ones the per-pod sequence handles
(docs/concepts.md, "Reload hazards beyond attention scales").

- Sleep level 2 with KV cache scales held as checkpoint parameters (vLLM #57163): refused
  (``UnsafeSleepLevel``) from refit_info.kv_cache_scales and the spec's sleepLevel.
- Level 2 without a full reload (#29341) and the prefix cache a reload never touches
  (#49789): every sleep level runs a full reload after the weights wake and resets the
  prefix cache before the probe (podflow.STEPS); tests/worker/test_reload_hazards.py shows
  the stale cache on a real engine.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from refit_operator.core import podflow
from refit_operator.core.admission import PreflightResult, admission_problem
from refit_operator.core.api import WeightRefitStatus
from refit_operator.core.decision import decide
from refit_worker.contract import RefitInfo

from tests.fixtures.refits import info, observe, pod, refit, spec

CT = info(kv_cache_dtype="fp8_e4m3", kv_cache_scales="compressed-tensors")


@pytest.mark.parametrize(
    ("level", "allow", "reason"),
    [
        (2, False, "UnsafeSleepLevel"),
        (1, False, None),  # level 1 keeps the scales in host memory and restores them
        (0, False, None),
        (2, True, None),  # allowUnsafeBackends: the user's call
    ],
)
def test_level_2_with_checkpoint_kv_scales(level: int, allow: bool, reason: str | None):
    problem = admission_problem(CT, allow, level)
    assert (problem and problem.reason) == reason
    if problem:
        assert "compressed-tensors" in problem.message and "#57163" in problem.message


def test_level_2_without_checkpoint_kv_scales_is_admitted():
    # fp8 KV cache with vLLM's default scales (no checkpoint parameters): unaffected.
    assert admission_problem(info(kv_cache_dtype="fp8"), False, 2) is None


def test_an_older_workers_refit_info_has_no_kv_cache_scales():
    doc = dataclasses.asdict(info())
    del doc["kv_cache_scales"]
    parsed = RefitInfo.from_json_dict(json.loads(json.dumps(doc)))
    assert parsed.kv_cache_scales == "" and admission_problem(parsed, False, 2) is None


def test_the_fleet_preflight_reads_the_specs_sleep_level():
    pre = PreflightResult(infos={"p0": CT})
    for level, phase in ((2, "Failed"), (1, "Progressing")):
        st = WeightRefitStatus(phase="Preflight")
        s = spec(sequence={"sleepLevel": level})
        d = decide(observe(refit(s, st), [pod("p0")], preflight=pre))
        assert d.status.phase == phase, level
        if phase == "Failed":
            ready = next(c for c in d.status.conditions if c.type == "Ready")
            assert ready.reason == "UnsafeSleepLevel" and ready.message.startswith("pod p0: ")


@pytest.mark.parametrize("level", [0, 1, 2])
def test_every_level_reloads_in_full_after_the_wake_and_resets_the_cache(level: int):
    """#29341 (level 2 without a full reload serves garbage) and #49789 (a reload leaves the
    prefix cache): the load (vLLM's layerwise reload of every tensor the model loads, which
    preflight checks the checkpoint holds) follows the weights' wake, and the prefix cache
    is reset before the probe, at every level."""
    steps = [s for s in podflow.STEPS if podflow.step_applies(s, level)]
    order = ["load", "resetCache", "probe", "ready"]
    if level:
        order = ["sleep", "wakeWeights", "load", "wakeKV", "resetCache", "probe", "ready"]
    assert [s for s in steps if s in order] == order


def test_a_pod_whose_drafter_the_worker_refits_is_admitted():
    # refit_worker.drafter: a draft_model drafter is loaded from the checkpoint's drafter/ with
    # its target, so the worker names it in refit_info.drafter and not as an unsafe reason.
    assert admission_problem(info(drafter="draft_model"), False, 2) is None


def test_an_older_workers_refit_info_has_no_drafter():
    doc = dataclasses.asdict(info())
    del doc["drafter"]
    assert RefitInfo.from_json_dict(json.loads(json.dumps(doc))).drafter == ""


def test_a_missing_drafter_leaves_the_pod_on_its_weights():
    # The worker refuses DrafterMissing before touching either model: final, and the pod
    # goes back to serving what it held.
    assert "DrafterMissing" in podflow.UNTOUCHED_LOAD_CODES
