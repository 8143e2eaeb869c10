"""spec.adapter on the real API server with simulated workers that take LoRA adapters at
runtime (testbed/simworker/, held to vLLM 0.32 by tests/worker/test_contract.py): adapter
refits beside refits of the base weights on the same pods, as a hostile user would drive them.

What it holds: an adapter refit never sleeps or reloads the base weights and leaves their
record alone; the two tracks neither queue on nor supersede each other, and their passes take
turns on a pod (one driver per pod: the fencing tokens never go down); a failed adapter rolls
back to the adapter the previous adapter refit served, not to a base checkpoint; a restarted
pod, which lost both, gets both back before it is in traffic again; two adapter names on the
same pods are two tracks; a fleet without runtime LoRA is refused before any pod changes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from testbed.fleet import assert_one_driver, make_checkpoints
from testbed.simworker import make_sim_adapter

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

END = {"Succeeded", "Failed", "Halted", "RolledBack"}
LORA = {"max_lora_rank": 16, "runtime_lora_updating": True}
# Steps a pass of the base weights runs on the pod, which an adapter pass must never call.
RELOAD = ("sleep", "wake_up", "refit_stage", "refit_load")
# What a refit may ask of a pod it refuses in the preflight: reads only.
READS = {"refit_info", "get_world_size", "refit_adapter_check", "models", "health", "metrics",
         "refit_ready"}  # fmt: skip
GATE = "refit.rollout.dev/weights-ready"


def adapters(root: Path, *versions: str, drift: dict[str, float] | None = None) -> dict:
    return {v: make_sim_adapter(root / "lora" / v, v, drift=(drift or {}).get(v, 0.0))
            for v in versions}  # fmt: skip


def adapter_refit(fleet: Any, op: Any, name: str, adapter: str, version: str, path: Path,
                  port: int, **spec: Any) -> dict[str, Any]:  # fmt: skip
    fleet.apply_refit(name, version, path, port, adapter=adapter, **spec)
    return dict(fleet.wait_phase(name, END, 120, op)["status"])


def served(sim: Any) -> dict[str, str]:
    """The adapters the pod holds now: name -> the directory's last part (its version)."""
    return {name: Path(path).name for name, path in sim.state()["adapters"].items()}


def test_adapter_refits_beside_the_base_weights(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = sim_fleet(3, allowed_root=tmp_path, **LORA)
    for i, sim in enumerate(sims):
        fleet.add_pod(f"vllm-{i}", sim)
    names = [f"vllm-{i}" for i in range(3)]
    ckpt = make_checkpoints(tmp_path, "v1")
    lora = adapters(tmp_path, "s1", "s2", "bad", drift={"bad": 2.0})
    op.start()
    fleet.apply_refit("base-v1", "v1", ckpt["v1"], sims[0].port)
    assert fleet.wait_phase("base-v1", END, 120, op)["status"]["phase"] == "Succeeded"
    base = {n: fleet.progress(fleet.pod(n)) for n in names}
    for sim in sims:
        sim.calls(clear=True)

    st = adapter_refit(fleet, op, "policy-s1", "policy", "s1", lora["s1"], sims[0].port,
                       strategy={"type": "Rolling", "maxUnavailable": 1})  # fmt: skip
    assert st["phase"] == "Succeeded" and st["updatedPods"] == 3, st
    assert st.get("previous") is None  # the base refit is no rollback target of an adapter
    for n, sim in zip(names, sims, strict=True):
        assert served(sim) == {"policy": "s1"}  # the staged name was unloaded
        assert not any(sim.counts().get(step) for step in RELOAD), sim.counts()
        assert fleet.progress(fleet.pod(n)) == base[n]  # the base weights' record: untouched
        record = fleet.adapter_progress(fleet.pod(n))["policy"]
        assert (record["refit"], record["version"], record["outcome"]) == (
            "policy-s1", "s1", "Succeeded",
        )  # fmt: skip
        assert fleet.ready(fleet.pod(n)) is True

    st = adapter_refit(fleet, op, "policy-s2", "policy", "s2", lora["s2"], sims[0].port)
    assert st["phase"] == "Succeeded" and st["previous"]["version"] == "s1", st
    # A drifting adapter: its staged probe fails on the canary, the rollout stops, and the
    # rollback goes to s2 (the adapter track's previous), never to the base checkpoint v1.
    st = adapter_refit(fleet, op, "policy-bad", "policy", "bad", lora["bad"], sims[0].port,
                       onFailure="Rollback", strategy={"type": "Rolling", "canary": 1})  # fmt: skip
    assert st["phase"] in ("RolledBack", "Halted"), st
    assert st["previous"]["version"] == "s2"
    for n, sim in zip(names, sims, strict=True):
        assert served(sim) == {"policy": "s2"}, (n, served(sim))
        assert fleet.ready(fleet.pod(n)) is True  # the old adapter served throughout
        assert fleet.progress(fleet.pod(n)) == base[n]
        assert sim.state()["loaded_version"] == "v1"
    for sim in sims:
        assert_one_driver(sim)


def test_a_restarted_pod_gets_both_tracks_back_before_traffic(harness, sim_fleet, tmp_path):
    """Adapters are loaded at runtime: a container restart loses the base weights and the
    adapter. The pod leaves traffic, the base weights' target reloads v1, the adapter's
    target loads s1 again (turns on the pod's claim), and only then is it in traffic."""
    fleet, op = harness
    sims = sim_fleet(2, allowed_root=tmp_path, **LORA)
    for i, sim in enumerate(sims):
        fleet.add_pod(f"vllm-{i}", sim)
    ckpt = make_checkpoints(tmp_path, "v1")
    lora = adapters(tmp_path, "s1")
    op.start()
    fleet.apply_refit("base-v1", "v1", ckpt["v1"], sims[0].port)
    assert fleet.wait_phase("base-v1", END, 120, op)["status"]["phase"] == "Succeeded"
    st = adapter_refit(fleet, op, "policy-s1", "policy", "s1", lora["s1"], sims[0].port)
    assert st["phase"] == "Succeeded", st

    sims[1].crash(restart_after=0.1)  # back fresh: no weights loaded, no adapter
    fleet.wait_for(lambda: sims[1].state()["up"] and not served(sims[1]), 10, "restarted")
    fleet.restart_container("vllm-1")
    fleet.wait_for(
        lambda: (
            served(sims[1]) == {"policy": "s1"}
            and sims[1].state()["loaded_version"] == "v1"
            and fleet.ready(fleet.pod("vllm-1")) is True
        ),
        90,
        "vllm-1 back with v1 and adapter s1",
    )
    pod = fleet.pod("vllm-1")
    base, record = fleet.progress(pod), fleet.adapter_progress(pod)["policy"]
    assert base is not None and (base["restarts"], base["outcome"]) == (1, "Succeeded")
    assert (record["restarts"], record["outcome"]) == (1, "Succeeded")
    assert served(sims[0]) == {"policy": "s1"} and fleet.ready(fleet.pod("vllm-0")) is True
    assert_one_driver(sims[1])


def test_tracks_do_not_queue_on_each_other_and_take_turns_on_a_pod(harness, sim_fleet, tmp_path):
    """A slow refit of the base weights in progress, then an adapter refit and a second
    adapter name on the same pods: neither adapter refit is Queued behind the base refit, each
    pass waits for the pod's claim, every refit Succeeds, and each name has its own record."""
    fleet, op = harness
    sims = sim_fleet(2, allowed_root=tmp_path, **LORA)
    for i, sim in enumerate(sims):
        fleet.add_pod(f"vllm-{i}", sim)
    ckpt = make_checkpoints(tmp_path, "v1")
    policy, critic = adapters(tmp_path, "s1"), adapters(tmp_path / "critic", "c1")
    op.start()
    for sim in sims:
        sim.set_fault("refit_load", "delay", 3.0, times=1)
    fleet.apply_refit("base-v1", "v1", ckpt["v1"], sims[0].port)
    fleet.wait_for(lambda: fleet.refit("base-v1").get("status", {}).get("phase")
                   == "Progressing", 30, "base refit in progress")  # fmt: skip
    fleet.apply_refit("policy-s1", "s1", policy["s1"], sims[0].port, adapter="policy")
    fleet.apply_refit("critic-c1", "c1", critic["c1"], sims[0].port, adapter="critic")
    phases: set[str] = set()

    def policy_ended() -> bool:
        phase = fleet.refit("policy-s1").get("status", {}).get("phase", "")
        phases.add(phase)
        return phase in END

    fleet.wait_for(policy_ended, 120, "policy-s1 ended")
    assert "Queued" not in phases, phases
    for name in ("base-v1", "policy-s1", "critic-c1"):
        assert fleet.wait_phase(name, END, 120, op)["status"]["phase"] == "Succeeded", name
    for i, sim in enumerate(sims):
        assert served(sim) == {"policy": "s1", "critic": "c1"}
        records = fleet.adapter_progress(fleet.pod(f"vllm-{i}"))
        assert {n: r["version"] for n, r in records.items()} == {"policy": "s1", "critic": "c1"}
        assert fleet.progress(fleet.pod(f"vllm-{i}"))["version"] == "v1"
        assert_one_driver(sim)


def test_a_fleet_without_runtime_lora_is_refused_before_any_change(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = sim_fleet(2, allowed_root=tmp_path)  # vLLM started without --enable-lora
    for i, sim in enumerate(sims):
        fleet.add_pod(f"vllm-{i}", sim)
    lora = adapters(tmp_path, "s1")
    op.start()
    st = adapter_refit(fleet, op, "policy-s1", "policy", "s1", lora["s1"], sims[0].port)
    assert st["phase"] == "Failed", st
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "AdapterUnsupported" and "--enable-lora" in ready["message"]
    for sim in sims:  # asked, never changed
        assert set(sim.counts()) <= {"refit_info", "get_world_size"}, sim.counts()


# ------------------------------------------------- a bad adapter changes nothing (issue 41)
def rewrite_weights(d: Path, shapes: dict[str, tuple[int, int]]) -> Path:
    """Replace a simulated adapter's weights by matrices of these names and shapes (PEFT
    naming under model.layers.0.self_attn), keeping its seed; the manifest written again."""
    import numpy as np
    from refit_worker.checkpoint import write_manifest
    from safetensors.numpy import save_file

    from testbed.simworker import SIM_ADAPTER_FILE

    prefix = "base_model.model.model.layers.0.self_attn"
    tensors = {f"{prefix}.{k}": np.zeros(s, dtype=np.float32) for k, s in shapes.items()}
    save_file(tensors, str(d / SIM_ADAPTER_FILE), metadata={"seed": d.name, "drift": "0.0"})
    write_manifest(d)
    return d


def bad_adapters(root: Path, outside: Path) -> dict[str, tuple[str, Path, str]]:
    """name -> (spec.adapter.name, path, the reason its refit must fail with)."""
    root = root / "bad"
    no_config = make_sim_adapter(root / "no-config", "no-config")
    (no_config / "adapter_config.json").unlink()
    from refit_worker.checkpoint import write_manifest

    write_manifest(no_config)
    wide = make_sim_adapter(root / "wide", "wide", rank=32)  # the pods take rank 16 at most
    foreign = rewrite_weights(make_sim_adapter(root / "foreign", "foreign"), {
        "query_key_value.lora_A.weight": (8, 2), "query_key_value.lora_B.weight": (6, 8),
    })  # fmt: skip
    other_base = rewrite_weights(make_sim_adapter(root / "other-base", "other-base"), {
        "q_proj.lora_A.weight": (8, 3), "q_proj.lora_B.weight": (3, 8),
    })  # fmt: skip
    good = make_sim_adapter(root / "good", "good")
    far = make_sim_adapter(outside, "far")
    return {
        "no-config": ("policy", no_config, "AdapterInvalid"),
        "wide": ("policy", wide, "AdapterRankTooHigh"),
        "foreign": ("policy", foreign, "AdapterModulesUnknown"),
        "other-base": ("policy", other_base, "AdapterBaseMismatch"),
        "base-name": ("sim-model", good, "AdapterNameConflict"),  # the served base model
        "others-adapter": ("critic", good, "AdapterNameConflict"),  # loaded by hand
        "outside-root": ("policy", far, "PathNotAllowed"),
    }


def load_by_hand(sim: Any, name: str, path: Path) -> None:
    """An adapter loaded into a pod by someone else than the operator (vLLM's own route)."""
    import json
    import urllib.request

    body = json.dumps({"lora_name": name, "lora_path": str(path)}).encode()
    request = urllib.request.Request(
        sim.base_url + "/v1/load_lora_adapter", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200


def test_a_bad_adapter_is_refused_before_any_pod_leaves_traffic(harness, sim_fleet, tmp_path):
    """The first adapter refit of a fleet that serves only its base model: every bad adapter
    is refused in the preflight with its own reason, before any pod is touched. Every pod
    stays in traffic throughout (sampled while each refit runs), its weights-ready condition
    and records unchanged, its /v1/models as it was; only reads reach the pods. Then a good
    adapter Succeeds on the same pods: nothing was left behind."""
    fleet, op = harness
    root = tmp_path / "root"
    sims = sim_fleet(2, allowed_root=root, **LORA)
    names = [f"vllm-{i}" for i in range(2)]
    for name, sim in zip(names, sims, strict=True):
        fleet.add_pod(name, sim)
    ckpt = make_checkpoints(root, "v1")
    bad = bad_adapters(root, tmp_path / "outside" / "far")
    load_by_hand(sims[1], "critic", bad["base-name"][1])
    op.start()
    fleet.apply_refit("base-v1", "v1", ckpt["v1"], sims[0].port)
    assert fleet.wait_phase("base-v1", END, 120, op)["status"]["phase"] == "Succeeded"

    def gates() -> dict[str, Any]:
        return {
            n: next(c for c in fleet.pod(n)["status"]["conditions"] if c["type"] == GATE)
            for n in names
        }

    def models() -> list[dict[str, str]]:
        return [served(sim) for sim in sims]

    before = (gates(), {n: fleet.progress(fleet.pod(n)) for n in names}, models())
    assert before[2] == [{}, {"critic": "good"}]
    for case, (adapter, path, reason) in bad.items():
        for sim in sims:
            sim.calls(clear=True)
        refit = f"bad-{case}"
        fleet.apply_refit(refit, case, path, sims[0].port, adapter=adapter)
        out_of_traffic: list[str] = []
        while fleet.refit(refit).get("status", {}).get("phase") not in END:
            out_of_traffic += [n for n in names if fleet.ready(fleet.pod(n)) is not True]
            time.sleep(0.05)
        st = fleet.wait_phase(refit, END, 5, op)["status"]
        ready = next(c for c in st["conditions"] if c["type"] == "Ready")
        assert (st["phase"], ready["reason"]) == ("Failed", reason), (case, st)
        assert not out_of_traffic, (case, out_of_traffic)
        assert (gates(), {n: fleet.progress(fleet.pod(n)) for n in names}, models()) == before
        for n, sim in zip(names, sims, strict=True):
            assert fleet.adapter_progress(fleet.pod(n)) == {}, (case, n)
            assert set(sim.counts()) <= READS, (case, n, sim.counts())

    good = bad["base-name"][1]
    st = adapter_refit(fleet, op, "policy-good", "policy", "good", good, sims[0].port)
    assert st["phase"] == "Succeeded", st
    assert models() == [{"policy": "good"}, {"critic": "good", "policy": "good"}]
    for sim in sims:
        assert_one_driver(sim)


def test_a_pod_that_joins_later_is_refused_before_its_claim(harness, sim_fleet, tmp_path):
    """A pod that joins the fleet after the preflight (here: after the adapter refit
    Succeeded, whose target it then is) gets the same adapter check before its pass claims
    it: a pod whose vLLM takes rank 4 is refused AdapterRankTooHigh and never loads the
    adapter. The refusal changes nothing the pod serves: its base weights, which the base
    refit (its target too) loaded and probed, keep it in traffic (core/gate.py: a refused
    first adapter holds nothing out), and clients asking it for the adapter get vLLM's 404."""
    fleet, op = harness
    sims = sim_fleet(2, allowed_root=tmp_path, **LORA)
    fleet.add_pod("vllm-0", sims[0])
    sims[1].set_state(max_lora_rank=4)
    ckpt = make_checkpoints(tmp_path, "v1")
    lora = adapters(tmp_path, "s1")
    op.start()
    fleet.apply_refit("base-v1", "v1", ckpt["v1"], sims[0].port)
    assert fleet.wait_phase("base-v1", END, 120, op)["status"]["phase"] == "Succeeded"
    st = adapter_refit(fleet, op, "policy-s1", "policy", "s1", lora["s1"], sims[0].port)
    assert st["phase"] == "Succeeded", st

    fleet.add_pod("vllm-1", sims[1])
    fleet.wait_for(
        lambda: (
            (fleet.adapter_progress(fleet.pod("vllm-1")).get("policy") or {}).get("outcome")
            == "Failed"
            and fleet.ready(fleet.pod("vllm-1")) is True
        ),
        90,
        "vllm-1's adapter pass refused, the pod in traffic on its base weights",
    )
    record = fleet.adapter_progress(fleet.pod("vllm-1"))["policy"]
    assert record["reason"] == "AdapterRankTooHigh", record
    assert "--max-lora-rank 4" in record["message"], record
    assert record["restored"] and not record["left_traffic"], record  # it never left traffic
    # refused by the admission (its message names the pod), not by a pass's stage step
    assert record["message"].startswith("pod vllm-1: adapter "), record
    counts = sims[1].counts()
    assert counts["refit_adapter_check"] and not counts.get("load_lora_adapter"), counts
    assert served(sims[1]) == {} and served(sims[0]) == {"policy": "s1"}
    assert fleet.ready(fleet.pod("vllm-0")) is True


def test_two_refits_of_one_adapter_created_at_once_queue(harness, sim_fleet, tmp_path):
    """Issue 41's bad input: two adapter refits of one name and different paths created in
    the same second. They are one track's queue: the second waits for the first (creation
    order), then refits every pod to its own adapter; each pod ends with the second adapter
    under the name and no staged name left. An adapter refit and a base refit created together
    are two tracks: both Succeed, their passes taking turns on each pod."""
    fleet, op = harness
    sims = sim_fleet(2, allowed_root=tmp_path, **LORA)
    names = [f"vllm-{i}" for i in range(2)]
    for name, sim in zip(names, sims, strict=True):
        fleet.add_pod(name, sim)
    ckpt = make_checkpoints(tmp_path, "v1")
    lora = adapters(tmp_path, "s1", "s2", "s3")
    op.start()
    fleet.apply_refit("base-v1", "v1", ckpt["v1"], sims[0].port)
    fleet.apply_refit("policy-s1", "s1", lora["s1"], sims[0].port, adapter="policy")
    for refit in ("base-v1", "policy-s1"):
        assert fleet.wait_phase(refit, END, 120, op)["status"]["phase"] == "Succeeded", refit
    for n, sim in zip(names, sims, strict=True):
        assert served(sim) == {"policy": "s1"} and sim.state()["loaded_version"] == "v1"
        assert fleet.ready(fleet.pod(n)) is True

    # Created in this order within one second, named against it: the operator's creation
    # stamp orders them, not their names.
    fleet.apply_refit("policy-z", "s2", lora["s2"], sims[0].port, adapter="policy")
    fleet.apply_refit("policy-a", "s3", lora["s3"], sims[0].port, adapter="policy")
    second = fleet.wait_phase("policy-a", END, 120, op)["status"]
    assert second["phase"] == "Succeeded", second
    # The first Succeeded, then its pods moved on to the second (woken by the second's finish).
    first = fleet.wait_phase("policy-z", "Superseded", 60, op)["status"]
    ready = {c["type"]: c for c in first["conditions"]}["Ready"]
    assert ready["reason"] == "PodsMovedOn" and "policy-a" in ready["message"], first
    assert first["completionTime"] <= second["startTime"], (first, second)
    for n, sim in zip(names, sims, strict=True):
        assert served(sim) == {"policy": "s3"}, (n, served(sim))
        assert fleet.adapter_progress(fleet.pod(n))["policy"]["refit"] == "policy-a"
        assert fleet.ready(fleet.pod(n)) is True
        assert_one_driver(sim)
