"""The fleet preflight's kept answers (core/preflight_cache.py): reused only while the pod's
process is the one that gave them, dropped with the pods, bounded; and when the preflight's
forward pass over the probe reference may be skipped."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest
from refit_operator.controller import inputs
from refit_operator.controller.refit_state import RefitState, Tick
from refit_operator.core.podview import PodView, images_in
from refit_operator.core.preflight_cache import (
    FleetAnswers,
    Fleets,
    PodAnswers,
    reference_unchecked,
)
from refit_worker.contract import REQUIRED_CAPABILITIES, RefitInfo

INFO = RefitInfo(
    vllm_version="0.32.0", attention_backend="CPU_ATTN", kv_cache_dtype="auto",
    cudagraph_mode="NONE", capabilities=REQUIRED_CAPABILITIES, unsafe_reasons=(),
    weight_version="v1", model="/m", allowed_root="/ckpt", vocab_size=512, max_model_len=64,
)  # fmt: skip
POD = PodView(
    name="p0", ip="10.0.0.1", has_gate=True, running=True, deleting=False, ready=True,
    restarts=0, progress=None, uid="u1", image="vllm=sha256:aa",
)  # fmt: skip


def _kept(pod: PodView = POD, info: RefitInfo = INFO) -> FleetAnswers:
    fleet = FleetAnswers()
    fleet.saw_info(pod, info)
    fleet.saw_world_size(pod, 1)
    return fleet


@pytest.mark.parametrize(
    ("case", "now", "info", "reused"),
    [
        ("unchanged", POD, None, True),
        ("unchanged but the weight version (a refit's own doing)", POD,
         replace(INFO, weight_version="v2"), True),
        ("uid changed (recreated under its name)", replace(POD, uid="u2"), None, False),
        ("container restarted", replace(POD, restarts=1), None, False),
        ("image changed", replace(POD, image="vllm=sha256:bb"), None, False),
        ("a follower replaced", replace(POD, incarnation="f2"), None, False),
        ("refit_info changed", POD, replace(INFO, unsafe_reasons=("x",)), False),
        ("refit_info changed its layout", POD, replace(INFO, tensor_parallel_size=2), False),
    ],
)  # fmt: skip
def test_answers_are_reused_only_for_the_process_that_gave_them(
    case: str, now: PodView, info: RefitInfo | None, reused: bool
) -> None:
    fleet = _kept()
    if info is not None:  # a fresh refit_info, from an admission or another preflight
        fleet.saw_info(now, info)
    got = fleet.get(now)
    assert (got is not None) == reused, case
    if got is not None:
        assert got.world_size == 1 and got.info == (info or INFO)


def test_a_fresh_info_without_its_world_size_is_not_reused() -> None:
    fleet = FleetAnswers()
    fleet.saw_info(POD, INFO)
    assert fleet.get(POD) is None and fleet.of_process(POD) is not None


def test_pods_gone_or_replaced_are_dropped_and_the_fleets_bounded() -> None:
    other = replace(POD, name="p1", uid="u9")
    fleet = _kept()
    fleet.saw_info(other, INFO)
    fleet.saw_world_size(other, 1)
    fleet.keep_only([replace(POD, restarts=3)])  # p1 gone, p0 restarted
    assert fleet.pods == {}
    fleets = Fleets(limit=2)
    first = fleets.of(("ns", "app=a", ""), [POD])
    first.saw_info(POD, INFO)
    fleets.of(("ns", "app=b", ""), [])
    fleets.of(("ns", "app=c", ""), [])
    assert len(fleets) == 2
    assert fleets.of(("ns", "app=a", ""), [POD]).pods == {}  # forgotten: asked again


PROMPTS = [[1, 2, 3], [4, 5]]


@pytest.mark.parametrize(
    ("case", "prompts", "answers", "key", "skipped"),
    [
        ("scored before with these credentials, ids and lengths fit", PROMPTS, "scored", None,
         True),
        ("never scored on these processes", PROMPTS, "unscored", None, False),
        ("another API key", PROMPTS, "scored", "k2", False),
        ("a token id outside the vocabulary", [[1, 512]], "scored", None, False),
        ("a prompt as long as max_model_len", [list(range(64))], "scored", None, False),
        ("an older worker: sizes unknown", PROMPTS, "old", None, False),
        ("a pod without refit_info", PROMPTS, "missing", None, False),
    ],
)  # fmt: skip
def test_the_forward_pass_is_skipped_only_where_it_tells_nothing_more(
    case: str, prompts: list[list[int]], answers: str, key: str | None, skipped: bool
) -> None:
    fleet = _kept()
    fleet.scored(POD, None)
    scored = fleet.of_process(POD)
    assert scored is not None
    choices: dict[str, list[PodAnswers | None]] = {
        "scored": [scored, replace(scored, scored_with=None)],
        "unscored": [replace(scored, scored_with=None)],
        "old": [replace(scored, info=replace(INFO, vocab_size=0, max_model_len=0))],
        "missing": [scored, None],
    }
    why = reference_unchecked(prompts, choices[answers], key, "checkpoint")
    assert (why is None) == skipped, (case, why)


def test_the_image_is_read_from_the_pod_object() -> None:
    spec = {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v1"}]}
    assert images_in(spec, {}) == "vllm=vllm/vllm-openai:v1"
    status = {"containerStatuses": [{"name": "vllm", "image": "x", "imageID": "sha256:aa"}]}
    assert images_in(spec, status) == "vllm=sha256:aa"  # the digest the kubelet pulled


def test_one_configmap_holding_the_manifest_and_the_reference_is_read_once() -> None:
    """RefitClient.broadcast writes both into <refit>-weights: the preflight read it twice."""
    reads: list[str] = []

    class Cluster:
        async def read_data(self, kind: str, namespace: str, name: str) -> dict[str, str]:
            reads.append(name)
            return {"transfer-manifest.json": "m", "refit-probe.json": "r"}

    async def main() -> list[str | None]:
        t = Tick({}, SimpleNamespace(namespace="ns"), RefitState())  # type: ignore[arg-type]
        keys = ("transfer-manifest.json", "refit-probe.json", "nope")
        return [await inputs.value(Cluster(), t, "ConfigMap", "w", k) for k in keys]  # type: ignore[arg-type]

    assert asyncio.run(main()) == ["m", "r", None]
    assert reads == ["w"]
