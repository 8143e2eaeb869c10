"""spec.adapter: an adapter refit is a fleet of its own beside the base weights' refits (its
own records on the pods, queue, history and rollback target), admitted by what LoRA needs
rather than by what a reload needs. Plain data, no server."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from pydantic import ValidationError
from refit_operator.core import admission, history, podflow
from refit_operator.core.admission import PreflightResult
from refit_operator.core.api_spec import WeightRefitSpec
from refit_operator.core.decision import decide
from refit_operator.core.index import RefitIndex
from refit_operator.core.podview import PodView
from refit_operator.core.reasons import Reason
from refit_worker.contract import RefitInfo

from tests.fixtures.refits import NOW, done, info, observe, pod, refit, spec

ADAPTER = {"name": "policy", "path": "/ckpt/lora/s2", "version": "s2"}
LORA = {"max_lora_rank": 16, "runtime_lora_updating": True}


def adapter_spec(**over: object) -> WeightRefitSpec:
    doc: dict[str, Any] = {
        "fleet": {"selector": {"matchLabels": {"app": "rollout"}}},
        "adapter": dict(ADAPTER),
        **over,
    }
    return WeightRefitSpec.model_validate(doc)


def test_an_adapter_spec_names_its_track_version_and_directory() -> None:
    s = adapter_spec()
    assert (s.track, s.version, s.path) == ("policy", "s2", "/ckpt/lora/s2")
    base = spec()
    assert (base.track, base.version, base.path) == ("", "v2", "/ckpt/v2")
    with pytest.raises(ValidationError):
        adapter_spec(adapter={"name": "policy", "path": "/x"})  # no version


def test_the_records_of_each_track_live_under_their_own_annotation() -> None:
    base = done(podflow.start("wr-base", "u1", "v2", "/ckpt/v2", NOW))
    lora = podflow.start("wr-lora", "u2", "s2", "/ckpt/lora/s2", NOW, source="adapter",
                         adapter="policy")  # fmt: skip
    assert podflow.progress_annotation(base.track) == podflow.PROGRESS_ANNOTATION
    key = podflow.progress_annotation(lora.track)
    assert key == "refit.rollout.dev/adapter-progress.policy" and len(key.split("/")[1]) <= 63
    doc = {
        "metadata": {"name": "p0", "uid": "x", "annotations": {
            podflow.PROGRESS_ANNOTATION: base.to_annotation(), key: lora.to_annotation(),
            podflow.ADAPTER_PROGRESS_PREFIX + "broken": "{not json",
        }},
        "spec": {}, "status": {"phase": "Running", "podIP": "127.0.0.2"},
    }  # fmt: skip
    view = PodView.from_pod(doc)
    assert view.progress == base  # the base weights' record, whatever adapters it serves
    assert view.on_track("") is view
    assert view.on_track("policy").progress == lora
    assert view.on_track("broken").progress is None  # unreadable: no record at all
    assert view.on_track("other").progress is None


def test_an_adapter_refit_decides_over_the_adapter_records_only() -> None:
    """A pod whose base weights passed a refit has no adapter record: the adapter refit
    starts a pass there (an adapter source), and a finished adapter pass counts as passed
    whatever the base record says."""
    r = refit(adapter_spec())
    base = done(podflow.start("wr-base", "u-base", "v2", "/ckpt/v2", NOW))
    p0 = pod("p0", base, adapter_records={})
    pre = PreflightResult(infos={"p0": info(**LORA)})
    d = decide(observe(r, [p0.on_track("policy")]))
    assert d.need_preflight
    d = decide(observe(refit(r.spec, d.status), [p0.on_track("policy")], preflight=pre))
    assert [(x.pod, x.version, x.path) for x in d.start] == [("p0", "s2", "/ckpt/lora/s2")]
    ran = done(podflow.start("wr", "uid", "s2", "/ckpt/lora/s2", NOW, source="adapter",
                             adapter="policy"))  # fmt: skip
    p0 = replace(p0, adapter_records={"policy": ran})
    d = decide(observe(refit(r.spec, d.status), [p0.on_track("policy")], preflight=pre))
    assert d.status.phase == "Succeeded" and d.status.updated_pods == 1
    assert not d.withdraw


def test_a_restart_withdraws_a_pod_whose_adapter_it_lost() -> None:
    """Adapters are loaded at runtime: a restarted container serves none of them, so a pod
    back in traffic without its adapter leaves it until the adapter refit converges it."""
    ran = done(podflow.start("wr", "uid", "s2", "/ckpt/lora/s2", NOW, source="adapter",
                             adapter="policy"))  # fmt: skip
    base = done(podflow.start("wr-base", "u-base", "v2", "/ckpt/v2", NOW))
    p0 = pod("p0", base, restarts=1, adapter_records={"policy": ran})
    st = decide(observe(refit(adapter_spec()), [p0.on_track("policy")])).status
    st.phase = "Succeeded"
    d = decide(observe(refit(adapter_spec(), st), [p0.on_track("policy")]))
    assert d.withdraw["p0"].reason == Reason.ContainerRestarted
    assert [x.pod for x in d.start] == ["p0"]


@pytest.mark.parametrize(
    ("lora", "words"),
    [
        ({}, "--enable-lora"),
        ({"max_lora_rank": 16}, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"),
    ],
)
def test_an_adapter_refit_refuses_pods_without_runtime_lora(
    lora: dict[str, Any], words: str
) -> None:
    problem = admission.admission_problem(info(**lora), True, 1, adapter=True)
    assert problem is not None and problem.reason == Reason.AdapterUnsupported
    assert words in problem.message  # allowUnsafeBackends does not lift it
    pre = PreflightResult(infos={"p0": info(**lora)})
    d = decide(observe(refit(adapter_spec()), [pod("p0")], preflight=pre))
    assert d.status.phase == "Failed" and not d.start
    assert d.status.conditions[0].reason == Reason.AdapterUnsupported


def test_what_a_reload_needs_does_not_concern_an_adapter_refit() -> None:
    unsafe = info(unsafe_reasons=("decode path under full CUDA graphs",), capabilities=(),
                  kv_cache_scales="compressed-tensors", **LORA)  # fmt: skip
    assert admission.admission_problem(unsafe, False, 2, adapter=True) is None
    assert admission.admission_problem(unsafe, False, 2) is not None


def test_refit_info_of_an_older_worker_reads_as_lora_off() -> None:
    doc = json.loads(json.dumps(info().to_json_dict()))  # as it comes over the wire
    del doc["max_lora_rank"], doc["runtime_lora_updating"]
    parsed = RefitInfo.from_json_dict(doc)
    assert (parsed.max_lora_rank, parsed.runtime_lora_updating) == (0, False)
    doc = json.loads(json.dumps(info(**LORA).to_json_dict()))
    assert RefitInfo.from_json_dict(doc) == info(**LORA)


def _doc(name: str, created: str, phase: str, source: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}",
                     "creationTimestamp": created},
        "spec": {"fleet": {"selector": {"matchLabels": {"app": "r"}}}, **source},
        "status": {"phase": phase, "completionTime": "2026-01-01T00:00:00Z"},
    }  # fmt: skip


def _adapter(name: str, version: str) -> dict[str, Any]:
    return {"adapter": {"name": name, "path": f"/lora/{name}/{version}", "version": version}}


def test_adapter_refits_queue_and_roll_back_among_themselves() -> None:
    """Refits of the base weights and of each adapter select the same pods, yet each track is
    a fleet of its own: an adapter refit neither waits for a base refit in progress nor
    takes a base checkpoint as its rollback target, and the other way round."""
    idx = RefitIndex()
    idx.observe(_doc("base-1", "2026-01-01T00:00:01Z", "Succeeded",
                     {"checkpoint": {"path": "/c/1", "version": "v1"}}))  # fmt: skip
    idx.observe(_doc("lora-1", "2026-01-01T00:00:02Z", "Succeeded", _adapter("policy", "s1")))
    idx.observe(_doc("other-1", "2026-01-01T00:00:03Z", "Succeeded", _adapter("critic", "c1")))
    idx.observe(_doc("base-2", "2026-01-01T00:00:04Z", "Progressing",
                     {"checkpoint": {"path": "/c/2", "version": "v2"}}))  # fmt: skip
    idx.observe(_doc("lora-2", "2026-01-01T00:00:05Z", "Pending", _adapter("policy", "s2")))
    pods = [pod("p0", None, labels={"app": "r"})]
    refs, previous = idx.sharing("ns", "u-lora-2", "2026-01-01T00:00:05Z", "Pending", pods)
    assert sorted(r.name for r in refs) == ["lora-1", "lora-2"]
    assert previous is not None and (previous.refit, previous.version, previous.path) == (
        "lora-1", "s1", "/lora/policy/s1",
    )  # fmt: skip
    refs, previous = idx.sharing("ns", "u-base-2", "2026-01-01T00:00:04Z", "Progressing", pods)
    assert sorted(r.name for r in refs) == ["base-1", "base-2"]
    assert previous is not None and previous.refit == "base-1"
    # A refit being deleted has left the index; the tick that releases its finalizer still
    # sees its own track's fleet (with the base's, another adapter's pass on the pod looked
    # foreign, and the pods were withdrawn FleetChanged for good: found by the explorer).
    refs, _ = idx.sharing("ns", "u-gone", "2026-01-01T00:00:06Z", "Succeeded", pods,
                          "policy", "lora-gone")  # fmt: skip
    assert sorted(r.name for r in refs) == ["lora-1", "lora-2"]


def test_history_keeps_each_tracks_target_and_limits_each_track_alone() -> None:
    def finished(name: str, minute: int, track: str) -> history.Finished:
        return history.Finished(name, f"2026-01-01T00:{minute:02d}:00Z", "Succeeded", 0.0, None,
                                "ns/app=r", pods=frozenset({"p0"}), track=track)  # fmt: skip

    refits = [finished("base-1", 1, ""), finished("base-2", 2, ""),
              *(finished(f"lora-{i}", 10 + i, "policy") for i in range(4))]  # fmt: skip
    doomed = history.to_delete(refits, history.Policy(history_limit=2), now=1e10)
    # base-2 is the base weights' target, though four adapter refits are newer.
    assert doomed == ["lora-0", "lora-1"]
    assert sorted(sorted(r.name for r in g) for g in history.fleets(refits)) == [
        ["base-1", "base-2"], [f"lora-{i}" for i in range(4)],
    ]  # fmt: skip


def test_a_pass_records_that_its_pod_runs_lora_for_a_resumed_probe() -> None:
    """The probe scores one prompt per request on a LoRA pod (a batch kills vLLM 0.32's
    LoRA-enabled CPU engine). A pass resumed after an operator restart runs no preflight to
    learn it: the pod's record carries it, and a record written before it reads as no LoRA."""
    ran = replace(podflow.start("wr", "uid", "s2", "/ckpt/lora/s2", NOW, source="adapter",
                                adapter="policy"), lora=True)  # fmt: skip
    back = podflow.Progress.from_annotation(ran.to_annotation())
    assert back is not None and back.lora and back == ran
    older = json.loads(ran.to_annotation())
    del older["lora"]
    parsed = podflow.Progress.from_annotation(json.dumps(older))
    assert parsed is not None and not parsed.lora


def test_a_base_refit_unloads_held_adapters_unless_told_to_reprobe_which_it_refuses() -> None:
    """spec.adapters.onBaseRefit: Unload (the default, also when omitted) runs the refit as
    before; Reprobe is not built yet, so the refit fails before any pod is asked (no preflight),
    rather than run as if it said Unload. An adapter refit cannot carry the field."""
    assert spec().adapters is None
    unload = spec(adapters={})
    assert unload.adapters is not None and unload.adapters.on_base_refit == "Unload"
    assert admission.spec_problem(unload) is None and admission.spec_problem(spec()) is None
    d = decide(observe(refit(unload), [pod("p0")]))
    assert d.need_preflight and d.status.phase == "Preflight"
    reprobe = spec(adapters={"onBaseRefit": "Reprobe"})
    d = decide(observe(refit(reprobe), [pod("p0")]))
    assert d.status.phase == "Failed" and not d.need_preflight and not d.start
    assert d.status.conditions[0].reason == Reason.AdapterReprobeUnsupported
    assert "not supported yet" in d.status.conditions[0].message
    with pytest.raises(ValidationError):
        spec(adapters={"onBaseRefit": "Keep"})
