"""Parallel layouts in the fleet preflight (docs/concepts.md, "Parallel layouts and
multi-pod replicas"): the pods of a fleet share one layout, a broadcast's ranks follow each
pod's /get_world_size, every worker the API server counts answers the refit's calls, and
refit_info carries the layout (older workers: TP1 PP1 DP1)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from refit_operator.core.admission import (
    PreflightResult,
    fleet_layout,
    joins_layout,
    layout_problem,
    reach_problem,
    world_size_problem,
)
from refit_operator.core.api import WeightRefitStatus
from refit_operator.core.decision import decide
from refit_worker.contract import ContractError, RefitInfo

from tests.fixtures.refits import info, observe, pod, refit, spec

TP2 = info(tensor_parallel_size=2)


def failed_reason(pre: PreflightResult, names: list[str]) -> tuple[str, str]:
    d = decide(
        observe(
            refit(spec(), WeightRefitStatus(phase="Preflight")),
            [pod(n) for n in names],
            preflight=pre,
        )
    )
    assert d.status.phase == "Failed"
    ready = next(c for c in d.status.conditions if c.type == "Ready")
    return ready.reason, ready.message


def test_refit_info_carries_the_layout_and_older_workers_read_as_one_worker() -> None:
    doc = json.loads(
        json.dumps(dataclasses.asdict(info(tensor_parallel_size=2, data_parallel_size=2)))
    )
    parsed = RefitInfo.from_json_dict(doc)
    assert (parsed.layout, parsed.workers) == ("TP2 PP1 DP2", 4)
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        del doc[key]
    assert RefitInfo.from_json_dict(doc).layout == "TP1 PP1 DP1"


@pytest.mark.parametrize("bad", [0, -1, True, "2", 1.5])
def test_a_malformed_parallel_size_is_a_contract_error(bad: object) -> None:
    doc = {**json.loads(json.dumps(dataclasses.asdict(info()))), "pipeline_parallel_size": bad}
    with pytest.raises(ContractError, match="pipeline_parallel_size must be a positive integer"):
        RefitInfo.from_json_dict(doc)


def test_a_fleet_of_one_layout_passes() -> None:
    assert layout_problem({"a": TP2, "b": TP2, "c": "unreachable"}) is None


def test_pods_that_disagree_on_their_layout_are_refused_before_any_is_touched() -> None:
    pre = PreflightResult(infos={"a": TP2, "b": TP2, "c": info()})
    reason, message = failed_reason(pre, ["a", "b", "c"])
    assert reason == "ParallelLayoutMismatch"
    assert message == (
        "the fleet's pods disagree on their parallel layout (TP2 PP1 DP1: a, b; TP1 PP1 DP1: c)"
    )


def test_the_refit_records_the_layout_its_preflight_found() -> None:
    """status.layout, written when the preflight admits the fleet: what a pod that joins later
    is held to, by this process or by one that took over after a restart."""
    pre = PreflightResult(infos={"a": TP2, "b": TP2}, world_sizes={"a": 2, "b": 2})
    d = decide(observe(refit(spec(), WeightRefitStatus(phase="Preflight")), [pod("a"), pod("b")],
                       preflight=pre))  # fmt: skip
    assert (d.status.phase, d.status.layout) == ("Progressing", "TP2 PP1 DP1")
    assert fleet_layout({"a": "unreachable", "b": TP2}) == "TP2 PP1 DP1"
    assert fleet_layout({"a": "unreachable"}) == ""


def test_a_pod_that_joins_later_must_run_the_fleets_layout() -> None:
    assert joins_layout("TP2 PP1 DP1", TP2) is None
    assert joins_layout("", info()) is None  # a status from before the record: nothing to hold
    problem = joins_layout("TP2 PP1 DP1", info())
    assert problem is not None and problem.reason == "ParallelLayoutMismatch"
    assert problem.message == (
        "the pod runs TP1 PP1 DP1, the fleet TP2 PP1 DP1 as its preflight found it: one "
        "checkpoint, one probe reference and one rank plan serve them all"
    )


def test_a_pod_whose_world_size_counts_workers_that_do_not_answer_is_refused() -> None:
    """Checkpoint and broadcast refits alike: the dense --data-parallel-size 2 pod as vLLM
    0.32 shows it (each engine reports DP 1, the API server counts 2), and a TP 2 pod whose
    API server counts 4."""
    assert world_size_problem({"a": TP2}, {"a": 2}) is None
    pre = PreflightResult(infos={"a": TP2, "b": info()}, world_sizes={"a": 2, "b": 2})
    reason, message = failed_reason(pre, ["a", "b"])
    assert reason == "ParallelLayoutMismatch"  # layouts are judged first
    pre = PreflightResult(infos={"a": info(), "b": info()}, world_sizes={"a": 1, "b": 2})
    reason, message = failed_reason(pre, ["a", "b"])
    assert reason == "WorkersOutOfReach"
    assert message == (
        "pod b: /get_world_size counts 2 workers but refit_info answers for 1 (TP1 PP1 DP1): "
        "the refit would not hear from the others (--data-parallel-size above 1 runs an "
        "engine per rank, and /collective_rpc answers with the first engine's results only); "
        "run one engine per pod"
    )
    pre = PreflightResult(infos={"a": TP2}, world_sizes={"a": 4})
    assert failed_reason(pre, ["a"])[0] == "WorkersOutOfReach"


def test_data_parallelism_behind_one_api_server_is_refused_whatever_the_world_size() -> None:
    dp2 = info(data_parallel_size=2)
    assert reach_problem(dp2, 2) == reach_problem(dp2, 1)
    pre = PreflightResult(infos={"a": dp2}, world_sizes={"a": 2})
    assert failed_reason(pre, ["a"]) == (
        "WorkersOutOfReach",
        "pod a: data parallelism 2 behind one API server: its /collective_rpc answers with "
        "the first engine's results only, so the others' loads could not be checked; run one "
        "engine per pod",
    )


def test_a_pod_that_does_not_say_its_world_size_is_refused() -> None:
    problem = world_size_problem({"a": TP2}, {"a": "get_world_size failed (http): HTTP 404"})
    assert problem is not None and problem.reason == "PodUnreachable"
    assert problem.message == "pod a: get_world_size failed (http): HTTP 404"
