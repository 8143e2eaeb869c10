"""One traffic gate per pod (core/gate.py), on the real API server with simulated LoRA workers:
the five ways a hostile review broke "no pod is in traffic unless a passed probe vouches for
everything it serves", where the base weights, adapters and pod groups meet (issue 41).

- a passing adapter probe never lets in a pod whose base weights failed;
- a later base refit never lets in a pod whose adapter failed after its swap (and the failed
  adapter leaves with the base pass's drain, its record holding the pod out until a refit of
  the adapter brings it back);
- nothing staged outlives a pass: after a rollback every pod holds exactly the adapters its
  records name;
- a group with a member gone Pending leaves traffic at once, without waiting for a pass, and
  its refit no longer counts it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from refit_operator.core.api_spec import LWS_GROUP_LABEL, LWS_INDEX_LABEL
from refit_worker.contract import READINESS_GATE

from testbed.fleet import LABELS, assert_one_driver, make_checkpoints
from testbed.simworker import make_sim_adapter

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

END = {"Succeeded", "Failed", "Halted", "RolledBack", "Superseded"}
LORA = {"max_lora_rank": 16, "runtime_lora_updating": True}


def served(sim: Any) -> dict[str, str]:
    """The adapters the pod holds (staged names included): name -> the directory's version."""
    return {name: Path(path).name for name, path in sim.state()["adapters"].items()}


def condition(fleet: Any, name: str) -> dict[str, Any]:
    pod = fleet.pod(name)
    return next(c for c in pod["status"]["conditions"] if c["type"] == READINESS_GATE)


def run(pods: Any, op: Any, name: str, version: str, path: Path, port: int, **spec: Any):
    pods.apply_refit(name, version, path, port, **spec)
    return dict(pods.wait_phase(name, END, 120, op)["status"])


def lora_fleet(harness: Any, sim_fleet: Any, tmp_path: Path, n: int = 2):
    fleet, op = harness
    sims = sim_fleet(n, allowed_root=tmp_path, **LORA)
    for i, sim in enumerate(sims):
        fleet.add_pod(f"vllm-{i}", sim)
    ckpt = make_checkpoints(tmp_path, "v1", "v2", "v3")
    lora = {v: make_sim_adapter(tmp_path / "lora" / v, v) for v in ("s1", "s2", "s3")}
    op.start()
    st = run(fleet, op, "base-v1", "v1", ckpt["v1"], sims[0].port)
    assert st["phase"] == "Succeeded", st
    return fleet, op, sims, ckpt, lora


def fail_after_the_swap(fleet: Any, sim: Any, name: str) -> None:
    """Arm ``sim`` so that the adapter pass's probe after the swap fails, the staged probe
    before it having passed: the drain's pause waits 3 s, and once the pass took the pod out of
    traffic (the record after the staged probe) the next probe's completions drift (a LoRA
    pod's probe scores each of the adapter's 3 prompts in a request of its own)."""
    sim.set_fault("pause", "delay", 3.0, times=1)
    fleet.wait_for(lambda: fleet.ready(fleet.pod(name)) is False, 60, f"{name} out for its swap")
    sim.set_fault("completions", "drift", 0.5, times=3)


def test_an_adapter_probe_never_readmits_a_pod_whose_base_failed(harness, sim_fleet, tmp_path):
    fleet, op, sims, ckpt, lora = lora_fleet(harness, sim_fleet, tmp_path)
    sims[1].set_fault("completions", "drift", 0.5)
    st = run(fleet, op, "base-v2", "v2", ckpt["v2"], sims[0].port, probe={"failureLimit": 1})
    assert st["phase"] == "Succeeded", st  # one failed pod within the limit
    sims[1].clear_faults()
    assert fleet.ready(fleet.pod("vllm-1")) is False
    st = run(fleet, op, "policy-s1", "s1", lora["s1"], sims[0].port, adapter="policy")
    assert st["phase"] == "Succeeded", st
    assert served(sims[1]) == {"policy": "s1"}  # the adapter's own pass passed there
    base = fleet.progress(fleet.pod("vllm-1"))
    assert base is not None and base["outcome"] == "Failed", base
    cond = condition(fleet, "vllm-1")  # held out by the base weights' failure, not let in
    assert (cond["status"], cond["reason"]) == ("False", base["reason"]), cond
    assert fleet.ready(fleet.pod("vllm-0")) is True
    # A refit of the base weights that passes there unloads the adapter at its drain; the
    # adapter was loaded on that version, so its refit loads it again, and only then is the
    # pod back in traffic.
    st = run(fleet, op, "base-v2b", "v2", ckpt["v2"], sims[0].port)
    assert st["phase"] == "Succeeded", st
    fleet.wait_for(
        lambda: fleet.ready(fleet.pod("vllm-1")) is True and served(sims[1]) == {"policy": "s1"},
        60,
        "vllm-1 back with its adapter",
    )
    assert served(sims[0]) == {"policy": "s1"} and fleet.ready(fleet.pod("vllm-0")) is True
    for sim in sims:
        assert_one_driver(sim)


def test_a_failed_adapter_holds_its_pod_out_through_a_base_refit(harness, sim_fleet, tmp_path):
    fleet, op, sims, ckpt, lora = lora_fleet(harness, sim_fleet, tmp_path)
    st = run(fleet, op, "policy-s1", "s1", lora["s1"], sims[0].port, adapter="policy")
    assert st["phase"] == "Succeeded", st
    fleet.apply_refit("policy-s2", "s2", lora["s2"], sims[0].port, adapter="policy",
                      strategy={"type": "Rolling", "maxUnavailable": 1},
                      probe={"failureLimit": 1})  # fmt: skip
    fail_after_the_swap(fleet, sims[0], "vllm-0")
    st = dict(fleet.wait_phase("policy-s2", END, 120, op)["status"])
    sims[0].clear_faults()
    record = fleet.adapter_progress(fleet.pod("vllm-0"))["policy"]
    assert record["outcome"] == "Failed" and record["step"] == "probe", record
    assert record["left_traffic"] > 0  # failed after the swap, not before it
    # Nothing staged outlives the pass: the failed adapter is the served name's only.
    assert served(sims[0]) == {"policy": "s2"}, served(sims[0])
    assert fleet.ready(fleet.pod("vllm-0")) is False

    # Re-probing held adapters on the new base is not built: such a base refit fails before
    # it asks anything of a pod, and every pod stays as it was (spec.adapters.onBaseRefit).
    for sim in sims:
        sim.calls(clear=True)
    before = [(served(sim), fleet.ready(fleet.pod(f"vllm-{i}"))) for i, sim in enumerate(sims)]
    st = run(fleet, op, "base-v2-reprobe", "v2", ckpt["v2"], sims[0].port,
             adapters={"onBaseRefit": "Reprobe"})  # fmt: skip
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert (st["phase"], ready["reason"]) == ("Failed", "AdapterReprobeUnsupported"), st
    assert "not supported yet" in ready["message"]
    assert [sim.calls() for sim in sims] == [[], []]
    assert [(served(sim), fleet.ready(fleet.pod(f"vllm-{i}"))) for i, sim in enumerate(sims)] == (
        before
    )
    # A refit of the base weights (Unload, the default, said here) passes on the pod, and
    # unloads its adapters at the drain, but the failed adapter's record holds it out: no
    # pass ending last sets the gate.
    st = run(fleet, op, "base-v2", "v2", ckpt["v2"], sims[0].port,
             adapters={"onBaseRefit": "Unload"})  # fmt: skip
    assert st["phase"] == "Succeeded", st
    assert sims[0].state()["loaded_version"] == "v2" and served(sims[0]) == {}
    cond = condition(fleet, "vllm-0")
    assert (cond["status"], cond["reason"]) == ("False", record["reason"]), cond
    assert "adapter policy s2 failed" in cond["message"]
    # The other pod: its adapter s1, probed on v1, was unloaded with v1; not served, and it
    # holds nothing out. Its old refit no longer answers for the pods (BaseChanged).
    assert served(sims[1]) == {} and fleet.ready(fleet.pod("vllm-1")) is True
    # A refit of the adapter for the new base brings the pod back.
    st = run(fleet, op, "policy-s3", "s3", lora["s3"], sims[0].port, adapter="policy")
    assert st["phase"] == "Succeeded", st
    assert fleet.ready(fleet.pod("vllm-0")) is True
    assert served(sims[0]) == served(sims[1]) == {"policy": "s3"}
    for sim in sims:
        assert_one_driver(sim)


def test_a_rolled_back_adapter_leaves_only_what_the_records_name(harness, sim_fleet, tmp_path):
    fleet, op, sims, _, lora = lora_fleet(harness, sim_fleet, tmp_path)
    st = run(fleet, op, "policy-s1", "s1", lora["s1"], sims[0].port, adapter="policy")
    assert st["phase"] == "Succeeded", st
    fleet.apply_refit("policy-s2", "s2", lora["s2"], sims[0].port, adapter="policy",
                      onFailure="Rollback",
                      strategy={"type": "Rolling", "maxUnavailable": 1})  # fmt: skip
    fail_after_the_swap(fleet, sims[0], "vllm-0")
    st = dict(fleet.wait_phase("policy-s2", END, 120, op)["status"])
    assert st["phase"] == "RolledBack", st
    for i, sim in enumerate(sims):
        record = fleet.adapter_progress(fleet.pod(f"vllm-{i}"))["policy"]
        assert served(sim) == {"policy": record["version"]} == {"policy": "s1"}, served(sim)
        assert fleet.ready(fleet.pod(f"vllm-{i}")) is True


def test_a_group_with_a_member_gone_pending_leaves_traffic_at_once(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = sim_fleet(2, allowed_root=tmp_path)
    for index, sim in enumerate(sims):
        labels = {**LABELS, LWS_GROUP_LABEL: "g1", LWS_INDEX_LABEL: str(index)}
        fleet.add_pod(f"g1-{index}", sim, labels=labels)
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    st = run(fleet, op, "wr", "v1", ckpt["v1"], sims[0].port, fleet={"groups": {}})
    assert st["phase"] == "Succeeded" and st["updatedPods"] == 1, st
    assert fleet.ready(fleet.pod("g1-0")) is fleet.ready(fleet.pod("g1-1")) is True

    # The follower is deleted and created again, Pending (no node yet): no pass can start on
    # the group, and its leader leaves traffic all the same.
    fleet.core.delete_namespaced_pod("g1-1", fleet.ns, grace_period_seconds=0)
    fleet.wait_for(lambda: "g1-1" not in {p["metadata"]["name"] for p in fleet.pods()}, 30, "gone")
    labels = {**LABELS, LWS_GROUP_LABEL: "g1", LWS_INDEX_LABEL: "1"}
    fleet.core.create_namespaced_pod(fleet.ns, {
        "metadata": {"name": "g1-1", "labels": labels},
        "spec": {"containers": [{"name": "vllm", "image": "x"}],
                 "readinessGates": [{"conditionType": READINESS_GATE}]},
    })  # fmt: skip
    fleet.wait_for(lambda: fleet.ready(fleet.pod("g1-0")) is False, 30, "the leader withdrawn")
    cond = condition(fleet, "g1-0")
    assert cond["reason"] == "MemberNotRunning", cond
    fleet.wait_for(lambda: fleet.refit("wr")["status"].get("updatedPods") == 0, 30, "not counted")
    assert sims[0].counts().get("refit_load", 0) == 1  # withdrawn without a pass

    # Once it runs, the group's target refits the whole group and it comes back as one.
    status = {"status": {"phase": "Running", "podIP": sims[1].ip, "podIPs": [{"ip": sims[1].ip}]}}
    fleet.core.patch_namespaced_pod_status("g1-1", fleet.ns, status)
    fleet.wait_for(
        lambda: fleet.ready(fleet.pod("g1-0")) is True and fleet.ready(fleet.pod("g1-1")) is True,
        60,
        "the group back as one",
    )
    assert sims[0].counts()["refit_load"] == 2
    assert fleet.refit("wr")["status"]["updatedPods"] == 1
