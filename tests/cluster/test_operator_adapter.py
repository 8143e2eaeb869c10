"""spec.adapter on the real API server with simulated workers that take LoRA adapters at
runtime (testbed/simworker.py, held to vLLM 0.32 by tests/worker/test_contract.py): adapter
refits beside refits of the base weights on the same pods, as a hostile user would drive them.

What it holds: an adapter refit never sleeps or reloads the base weights and leaves their
record alone; the two tracks neither queue on nor supersede each other, and their passes take
turns on a pod (one driver per pod: the fencing tokens never go down); a failed adapter rolls
back to the adapter the previous adapter refit served, not to a base checkpoint; a restarted
pod, which lost both, gets both back before it is in traffic again; two adapter names on the
same pods are two tracks; a fleet without runtime LoRA is refused before any pod changes."""

from __future__ import annotations

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
