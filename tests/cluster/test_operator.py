"""The operator end to end on the real API server with simulated workers: each strategy,
queueing, convergence, rollback. The operator runs as the real `refit-operator` process."""

from __future__ import annotations

import contextlib
import json
import time

import pytest

from testbed.controlplane import CRD_DIR, WEIGHTREFIT_CRD
from testbed.fleet import make_checkpoints, start_fleet

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]
END = {"Succeeded", "Failed", "Halted"}

# A fresh, uninterrupted pass: no read-back of the weight version before the load (nothing can
# have loaded yet; a resumed or retried load reads back first, see test_operator_restart).
SEQUENCE = [
    "refit_stage", "pause", "sleep", "wake_up", "refit_load",
    "pause",  # wakeKV: abort what queued since the sleep, before the wake resumes vLLM
    "wake_up", "reset_prefix_cache", "resume", "update_weight_version", "weight_info",
    "weight_checker", "refit_buffer_digests",  # the read-back (checksum step)
    "refit_ready",  # GET, before the probe: which process the probe scores
    "refit_ready",  # POST, after the probe: the pass vouches for that process, then the gate
]  # fmt: skip


def refit_calls(calls: list[str]) -> list[str]:
    """The pod's calls from the stage on, without the probe's model listing/scoring."""
    start = calls.index("refit_stage")
    return [
        c
        for c in calls[start:]
        if c not in ("models", "completions", "refit_probe_reference", "health")
    ]


def test_all_at_once_refits_every_pod_in_order(harness, sim_fleet, tmp_path, control_plane):
    fleet, op = harness
    sims = sim_fleet(3, allowed_root=tmp_path)
    ckpt = make_checkpoints(tmp_path, "v1")
    for i, sim in enumerate(sims):
        fleet.add_pod(f"pod-{i}", sim)
    op.start()
    fleet.apply_refit("wr1", "v1", ckpt["v1"], sims[0].port)
    fleet.wait_phase("wr1", {"Succeeded", "Failed", "Halted"}, 60, op)
    proc = control_plane.kubectl(
        "wait", "-n", fleet.ns, "--for=condition=Ready", "wr/wr1", "--timeout=20s", check=False
    )
    assert proc.returncode == 0, proc.stderr + op.logs()
    doc = fleet.refit("wr1")
    st = doc["status"]
    assert st["phase"] == "Succeeded"
    assert (st["targetPods"], st["updatedPods"], st["failedPods"]) == (3, 3, 0)
    assert st["observedGeneration"] == doc["metadata"]["generation"]
    conds = {c["type"]: c["status"] for c in st["conditions"]}
    assert conds == {"Ready": "True", "Progressing": "False", "Degraded": "False"}
    assert st["probeSummary"]["passed"] == 3
    # No pod needs attention, so the status lists none; each pod's record is on the pod.
    assert st["pods"] == [] and st["podsOmitted"] == 0
    for i in range(3):
        record = fleet.progress(fleet.pod(f"pod-{i}"))
        assert record is not None and record["uid"] == doc["metadata"]["uid"]
        assert record["outcome"] == "Succeeded" and record["version"] == "v1"
        assert record["probe"]["verdict"] == "Pass" and record["probe"]["tokens"] > 0
        assert set(record["step_seconds"]) >= {"drain", "load", "probe", "ready"}
    for i, sim in enumerate(sims):
        assert fleet.ready(fleet.pod(f"pod-{i}")) is True
        state = sim.state()
        assert state["weight_version"] == "v1"
        calls = refit_calls(sim.calls())
        assert calls == SEQUENCE, str(sim.calls())
        # Admitted by the fleet preflight's refit_info; the pass does not ask again.
        assert sim.calls().count("refit_info") == 1, str(sim.calls())
    # Pods that succeed get no Event each; the refit's Succeeded Event counts them.
    assert not fleet.events("PodRefitSucceeded")
    (done,) = fleet.events("Succeeded")
    assert done["message"].startswith("3/3 pods at v1"), done


def test_rolling_keeps_max_unavailable(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 4)
    # A slow load makes overlapping pods visible to the watcher.
    sims[0].fleet.set_fault("refit_load", "delay", 0.6)
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    strategy = {"type": "Rolling", "maxUnavailable": 1}
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port, strategy=strategy)
    st = fleet.wait_phase("wr", {"Succeeded", "Failed", "Halted"}, 90, op)["status"]
    assert st["phase"] == "Succeeded" and st["updatedPods"] == 4
    assert fleet.max_out_of_traffic == 1
    assert all(s.state()["weight_version"] == "v1" for s in sims)


def test_canary_failure_leaves_the_rest_untouched(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 3)
    sims[0].set_fault("completions", "drift", -1.0)
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port, strategy={"canary": 1})
    st = fleet.wait_phase("wr", {"Succeeded", "Failed", "Halted"}, 90, op)["status"]
    assert st["phase"] == "Halted"
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "FailureLimitExceeded"
    canary = next(p for p in st["pods"] if p["name"] == "pod-0")
    assert canary["phase"] == "Failed" and canary["reason"] == "LogprobDrift"
    assert canary["probe"]["verdict"] == "Fail"
    pod0 = fleet.pod("pod-0")
    assert fleet.ready(pod0) is False
    cond = next(c for c in pod0["status"]["conditions"] if c["type"].endswith("weights-ready"))
    assert cond["reason"] == "LogprobDrift"
    for sim in sims[1:]:
        assert "refit_stage" not in sim.calls() and "refit_load" not in sim.calls()


def test_queue_runs_refits_of_a_fleet_one_at_a_time(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    sims[0].fleet.set_fault("refit_load", "delay", 2.0)
    ckpt = make_checkpoints(tmp_path, "v1", "v2")
    fleet.apply_refit("wr-a", "v1", ckpt["v1"], sims[0].port)
    fleet.apply_refit("wr-b", "v2", ckpt["v2"], sims[0].port)
    op.start()
    fleet.wait_phase("wr-a", "Progressing", 30, op)
    queued = fleet.wait_phase("wr-b", "Queued", 30, op)["status"]
    assert queued["queuePosition"] == 1
    fleet.wait_phase("wr-a", "Succeeded", 60, op)
    st = fleet.wait_phase("wr-b", "Succeeded", 60, op)["status"]
    assert st["previous"]["version"] == "v1" and st["previous"]["refit"] == "wr-a"
    assert all(s.state()["weight_version"] == "v2" for s in sims)


def test_latest_wins_supersedes_queued_refits(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    sims[0].fleet.set_fault("refit_load", "delay", 2.0)
    ckpt = make_checkpoints(tmp_path, "v1", "v2", "v3")
    op.start()
    fleet.apply_refit("wr-a", "v1", ckpt["v1"], sims[0].port)
    fleet.wait_phase("wr-a", "Progressing", 30, op)
    fleet.apply_refit("wr-b", "v2", ckpt["v2"], sims[0].port)
    fleet.wait_phase("wr-b", "Queued", 30, op)
    fleet.apply_refit("wr-c", "v3", ckpt["v3"], sims[0].port, queuePolicy="LatestWins")
    st = fleet.wait_phase("wr-b", "Superseded", 30, op)["status"]
    assert "wr-c" in st["message"]
    fleet.wait_phase("wr-c", "Succeeded", 90, op)
    assert all(s.state()["weight_version"] == "v3" for s in sims)
    assert all("refit_load" in s.calls() for s in sims)
    loads = [c for c in sims[0].call_log() if c["step"] == "refit_load"]
    assert len(loads) == 2  # v1 and v3, never v2


def test_late_and_restarted_pods_converge_before_ready(harness, sim_fleet, tmp_path):
    """Late and restarted pods are refitted before they are Ready. Each pod process is asked
    its refit_info once: the next refit of the unchanged fleet asks none (issue 43)."""
    fleet, op = harness
    sims = sim_fleet(3, allowed_root=tmp_path)
    for i in range(2):
        fleet.add_pod(f"pod-{i}", sims[i])
    ckpt = make_checkpoints(tmp_path, "v1", "v2")
    op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port)
    fleet.wait_phase("wr", "Succeeded", 60, op)
    fleet.add_pod("late", sims[2])
    fleet.wait_for(lambda: fleet.ready(fleet.pod("late")) is True, 60, "late pod Ready")
    assert sims[2].state()["weight_version"] == "v1"
    assert sims[2].counts()["refit_info"] == 1  # its admission asked it
    for sim in sims:
        sim.calls(clear=True)
    # A container restart loses the weights: the pod is refitted again before Ready.
    sims[1].crash()
    sims[1].restart()
    fleet.restart_container("pod-1")
    fleet.wait_for(lambda: sims[1].state()["weight_version"] == "v1", 60, "pod-1 refitted")
    fleet.wait_for(lambda: fleet.ready(fleet.pod("pod-1")) is True, 60, "pod-1 Ready")
    # The status follows on the next reconcile tick (it is written per tick, not per pod).
    fleet.wait_for(lambda: fleet.refit("wr")["status"]["updatedPods"] == 3, 15, "status")
    st = fleet.refit("wr")["status"]
    assert st["phase"] == "Succeeded" and st["targetPods"] == 3 and st["updatedPods"] == 3
    # Another process answers: asked again; the others were not.
    assert sims[1].counts()["refit_info"] == 1, sims[1].calls()
    assert "refit_info" not in sims[0].calls() + sims[2].calls()
    # A refit of the unchanged fleet takes every answer from the preflight cache
    # (core/preflight_cache.py): no refit_info, no /get_world_size, and no forward pass
    # beside each pod's probe (the pods' refit_info shows the reference fits the model).
    for sim in sims:
        sim.calls(clear=True)
    fleet.apply_refit("wr-2", "v2", ckpt["v2"], sims[0].port)
    assert fleet.wait_phase("wr-2", END, 60, op)["status"]["phase"] == "Succeeded"
    for sim in sims:
        counts = sim.counts()
        assert counts["refit_info"] == counts["get_world_size"] == 0, sim.calls()
        assert counts["completions"] == 1, sim.calls()  # its pass's probe
        assert sim.state()["weight_version"] == "v2"


def test_rollback_returns_moved_pods_to_the_previous_version(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 3)
    ckpt = make_checkpoints(tmp_path, "v1", "v2", drift={"v2": 0.0})
    op.start()
    fleet.apply_refit("wr-1", "v1", ckpt["v1"], sims[0].port)
    fleet.wait_phase("wr-1", "Succeeded", 60, op)
    sims[2].set_fault("completions", "drift", -1.0, times=1)
    fleet.apply_refit("wr-2", "v2", ckpt["v2"], sims[0].port, onFailure="Rollback")
    st = fleet.wait_phase("wr-2", {"RolledBack", "Failed", "Halted", "Succeeded"}, 90, op)
    st = st["status"]
    assert st["phase"] == "RolledBack", st
    assert st["previous"] == {"version": "v1", "path": str(ckpt["v1"]), "refit": "wr-1"}
    assert all(s.state()["weight_version"] == "v1" for s in sims)
    for i in range(3):
        assert fleet.ready(fleet.pod(f"pod-{i}")) is True
    # Rolled back pods need no attention: not listed; each pod's record is the rollback pass.
    assert st["pods"] == []
    uid = fleet.refit("wr-2")["metadata"]["uid"]
    for i in range(3):
        record = fleet.progress(fleet.pod(f"pod-{i}"))
        assert record is not None and record["uid"] == uid and record["rollback"] is True
        assert (record["outcome"], record["version"]) == ("Succeeded", "v1")


def test_deleting_a_refit_mid_way_leaves_pods_safe(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    sims[0].fleet.set_fault("refit_load", "delay", 3.0)
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port)
    fleet.wait_serving(sims[0], "refit_load", timeout=30)
    fleet.custom.delete_namespaced_custom_object(
        "refit.rollout.dev", "v1alpha1", fleet.ns, "weightrefits", "wr"
    )

    def gone() -> bool:
        try:
            fleet.refit("wr")
        except Exception:
            return True
        return False

    fleet.wait_for(gone, 60, "the finalizer to let go")
    # The passes in flight finished before the finalizer was released: no pod is asleep,
    # paused or half loaded, and each one is Ready only with a passed probe.
    for i, sim in enumerate(sims):
        state = sim.state()
        p = fleet.progress(fleet.pod(f"pod-{i}"))
        assert p is not None and p["outcome"] == "Succeeded", p
        assert state["weight_version"] == "v1" and not state["paused"] and not state["asleep"]


def test_pod_deleted_mid_refit_is_dropped(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 3)
    sims[2].set_fault("refit_load", "hang")
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    seq = {"loadTimeoutSeconds": 30}
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port, sequence=seq)
    fleet.wait_serving(sims[2], "refit_load", timeout=30)
    fleet.core.delete_namespaced_pod("pod-2", fleet.ns, grace_period_seconds=0)
    st = fleet.wait_phase("wr", {"Succeeded", "Failed", "Halted"}, 90, op)["status"]
    assert st["phase"] == "Succeeded" and st["targetPods"] == 2, st
    dropped = next(p for p in st["pods"] if p["name"] == "pod-2")
    assert (dropped["phase"], dropped["reason"]) == ("Dropped", "PodDeleted")


@contextlib.contextmanager
def _crd_without_sequence_rule(control_plane, ns: str, name: str):
    """The CRD as an older installation had it: spec.sequence without its immutability rule
    (an API server that accepts a change). crds/ is applied again at the end, and the rule
    is back in force before the next test."""
    crd = json.loads(control_plane.kubectl("get", "crd", WEIGHTREFIT_CRD, "-o", "json").stdout)
    seq = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["sequence"]  # fmt: skip
    seq.pop("x-kubernetes-validations")
    control_plane.kubectl("replace", "-f", "-", input=json.dumps(crd))
    try:
        yield
    finally:
        control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_DIR))

        def refused() -> bool:
            patch = json.dumps({"spec": {"sequence": {"retries": 7}}})
            proc = control_plane.kubectl("patch", "-n", ns, "wr", name, "--type=merge",
                                         "--dry-run=server", "-p", patch, check=False)  # fmt: skip
            return proc.returncode != 0 and "spec.sequence is immutable" in proc.stderr

        deadline = time.monotonic() + 30
        while not refused():
            assert time.monotonic() < deadline, "the CRD's sequence rule did not come back"
            time.sleep(0.5)


@pytest.mark.failover
def test_a_sequence_changed_past_an_older_crd_never_reaches_the_passes(
    harness, sim_fleet, tmp_path, control_plane
):
    """spec.sequence changed mid-refit to sleepLevel 0 (accepted by a CRD without the rule),
    then the operator restarted: the passes keep the sleep level the preflight admitted.
    Acting on the change would skip the wakes on a pod slept at level 1 (its probe would
    wait on a sleeping engine) and skip sleep on the next pods."""
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    sims[0].fleet.set_fault("refit_load", "delay", 2.0)
    ckpt = make_checkpoints(tmp_path, "v1")
    first = op.start()
    rolling = {"type": "Rolling", "maxUnavailable": 1}
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port, strategy=rolling,
                      sequence={"probeTimeoutSeconds": 5})  # fmt: skip
    fleet.wait_serving(sims[0], "refit_load")  # pod-0 asleep at level 1, loading
    admitted = fleet.refit("wr")["status"]["sequence"]
    assert admitted["sleepLevel"] == 1, admitted
    with _crd_without_sequence_rule(control_plane, fleet.ns, "wr"):
        changed = json.dumps({"spec": {"sequence": {"sleepLevel": 0}}})
        deadline = time.monotonic() + 30  # until the API server serves the older schema
        while control_plane.kubectl("patch", "-n", fleet.ns, "wr", "wr", "--type=merge", "-p",
                                    changed, check=False).returncode:  # fmt: skip
            assert time.monotonic() < deadline, "the API server kept refusing the change"
            time.sleep(0.3)
        op.kill(first)  # the record, not the operator's memory, must carry it
        sims[0].fleet.clear_faults()
        op.start()
        st = fleet.wait_phase("wr", {"Succeeded", "Failed", "Halted"}, 90, op)["status"]
    doc = fleet.refit("wr")
    assert doc["spec"]["sequence"]["sleepLevel"] == 0  # the server did accept it
    assert st["phase"] == "Succeeded", st
    assert st["sequence"] == admitted
    for sim in sims:
        calls = sim.call_log()
        # (pod-0's resumed pass repeats its sleep: idempotent, at the same level)
        levels = [c["params"].get("level") for c in calls if c["step"] == "sleep"]
        assert levels and set(levels) == {"1"}, levels
        tags = [c["params"].get("tags") for c in calls if c["step"] == "wake_up"]
        assert tags[-2:] == ["weights", "kv_cache"], tags
        assert sim.state()["weight_version"] == "v1" and not sim.state()["asleep"]
    assert "keeps the sequence it admitted" in op.logs()
