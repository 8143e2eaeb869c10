"""The operator process killed (SIGKILL) at every step boundary and restarted: the refit
completes, no load is repeated blindly, and no pod is Ready without a passed probe. Also the
HA pair: two replicas, exactly one acts, the standby takes over when the leader dies."""

from __future__ import annotations

import time

import pytest
from kubernetes import client as k8s
from refit_operator.core.podflow import STEPS

from testbed.fleet import make_checkpoints, start_fleet

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

# The simulator endpoint behind each step (slowed down so the kill lands inside the step),
# and the wake_up tag that tells the two wakes apart.
ENDPOINT = {
    "stage": "refit_stage", "drain": "pause", "sleep": "sleep", "wakeWeights": "wake_up",
    "load": "refit_load", "wakeKV": "wake_up", "resetCache": "reset_prefix_cache",
    "stampVersion": "update_weight_version", "probe": "completions", "ready": "refit_ready",
}  # fmt: skip
TAGS = {"wakeWeights": "weights", "wakeKV": "kv_cache"}
# The fleet preflight also scores a prompt: the probe's completions come after the stamp.
AFTER = {"probe": "weight_info"}


@pytest.mark.failover
@pytest.mark.parametrize("step", [s for s in STEPS if s in ENDPOINT])
def test_killed_at_step_resumes(harness, sim_fleet, tmp_path, step):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    sims[0].fleet.set_fault(ENDPOINT[step], "delay", 2.0)
    ckpt = make_checkpoints(tmp_path, "v1")
    first = op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port)
    fleet.wait_serving(sims[0], ENDPOINT[step], TAGS.get(step), after=AFTER.get(step))
    time.sleep(0.5)  # inside the (slowed) step
    op.kill(first)
    assert fleet.refit("wr")["status"]["phase"] == "Progressing"
    sims[0].fleet.clear_faults()
    op.start()
    st = fleet.wait_phase("wr", {"Succeeded", "Failed", "Halted"}, 90, op)["status"]
    assert st["phase"] == "Succeeded", st
    for i, sim in enumerate(sims):
        assert sim.state()["weight_version"] == "v1"
        assert fleet.ready(fleet.pod(f"pod-{i}")) is True
        assert sim.state()["vouched"] == "v1"  # its readiness probe passes too
        loads = sim.counts()["refit_load"]
        # Killed after the load finished: the restarted operator reads the version back
        # and does not load again. Killed during the load: at most one more.
        assert loads == 1 if STEPS.index(step) > STEPS.index("load") else loads <= 2


@pytest.mark.failover
def test_ha_standby_takes_over_mid_refit(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 3)
    sims[0].fleet.set_fault("refit_load", "delay", 3.0)
    ckpt = make_checkpoints(tmp_path, "v1")
    leader = op.start()
    fleet.wait_for(lambda: "acquired" in op.logs(), 30, "the first replica to lead")
    standby = op.start()
    time.sleep(2.0)
    lease = k8s.CoordinationV1Api(fleet.api).read_namespaced_lease("refit-operator", fleet.ns)
    holder = lease.spec.holder_identity if lease.spec else None
    assert holder is not None and holder.startswith("op0-"), holder
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port)
    fleet.wait_serving(sims[0], "refit_load")
    op.kill(leader)
    st = fleet.wait_phase("wr", {"Succeeded", "Failed", "Halted"}, 90, op)["status"]
    assert st["phase"] == "Succeeded", st
    assert standby.poll() is None
    log1 = (op.log_dir / "operator-1.log").read_text()
    assert "acquired by op1-" in log1
    assert all(s.state()["weight_version"] == "v1" for s in sims)
