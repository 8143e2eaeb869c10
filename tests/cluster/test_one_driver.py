"""One driver per pod, and Succeeded means serving, on the real API server with the real
operator process: refits whose selectors overlap (both orders of arrival, several selector
shapes), a refit that meets a pod another refit's pass holds, a leader frozen (SIGSTOP) past
its lease at several steps and thawed while the new leader drives the pod, and a pod that
receives a call with a stale fencing token. Every test also checks the harness's invariant:
no pod Ready without a passed probe at the version it records."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import pytest
from refit_worker import contract

from testbed.fleet import assert_one_driver, fenced_calls, make_checkpoints
from testbed.operator_process import FAILOVER_LEASE_SECONDS

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

END = {"Succeeded", "Failed", "Halted", "RolledBack", "Superseded"}
BOTH = {"app": "rollout", "tier": "gen"}

# (first refit's selector, second refit's selector): different texts, overlapping pods.
SHAPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "labels": ({"matchLabels": {"app": "rollout"}}, {"matchLabels": {"tier": "gen"}}),
    "expressions": (
        {"matchExpressions": [{"key": "app", "operator": "In", "values": ["rollout"]}]},
        {"matchExpressions": [{"key": "tier", "operator": "Exists"}]},
    ),
    "mixed": (
        {"matchLabels": {"tier": "gen"}},
        {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gen", "eval"]}]},
    ),
}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        present = e["key"] in labels
        if e["operator"] == "In" and not (present and labels[e["key"]] in e["values"]):
            return False
        if e["operator"] == "Exists" and not present:
            return False
    return True


@pytest.mark.parametrize("order", ["first-then-second", "second-then-first"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_overlapping_refits_take_turns(harness, sim_fleet, tmp_path, shape, order):
    fleet, op = harness
    # pod-0..2 carry both labels; pod-3 only app=rollout (selected by one shape's first only).
    labels = [BOTH, BOTH, BOTH, {"app": "rollout"}]
    sims = sim_fleet(len(labels), allowed_root=tmp_path)
    for i, (sim, lab) in enumerate(zip(sims, labels, strict=True)):
        fleet.add_pod(f"pod-{i}", sim, labels=lab)
    ckpt = make_checkpoints(tmp_path, "va", "vb")
    sel = dict(zip(("wa", "wb"), SHAPES[shape], strict=True))
    names = ["wa", "wb"] if order == "first-then-second" else ["wb", "wa"]
    sims[0].fleet.set_fault("refit_load", "delay", 1.0)  # the first refit is still at work
    op.start()
    older, newer = names
    version = {"wa": "va", "wb": "vb"}
    fleet.apply_refit(older, version[older], ckpt[version[older]], sims[0].port,
                      fleet={"selector": sel[older]})  # fmt: skip
    fleet.wait_for(lambda: any(s.counts()["refit_load"] for s in sims), 60, "the first load")
    fleet.apply_refit(newer, version[newer], ckpt[version[newer]], sims[0].port,
                      fleet={"selector": sel[newer]})  # fmt: skip
    # The newer refit waits for the older one, and says which.
    queued = fleet.wait_phase(newer, {"Queued"}, 30, op)["status"]
    assert older in queued["message"], queued
    new_st = fleet.wait_phase(newer, END, 120, op)["status"]
    assert new_st["phase"] == "Succeeded", new_st
    sims[0].fleet.clear_faults()

    selected = {
        n: {f"pod-{i}" for i, lab in enumerate(labels) if _selects(sel[n], lab)} for n in names
    }
    kept = selected[older] - selected[newer]  # the older refit's pods nobody took over
    serving = {f"pod-{i}": s.state()["weight_version"] for i, s in enumerate(sims)}
    assert all(serving[p] == version[newer] for p in selected[newer]), serving
    assert all(serving[p] == version[older] for p in kept), serving

    def older_settled() -> bool:
        st = fleet.refit(older).get("status") or {}
        return st.get("phase") == ("Succeeded" if kept else "Superseded") and "moved on" in st.get(
            "message", ""
        )

    fleet.wait_for(older_settled, 30, f"{older} to report its pods moved on")
    old_st = fleet.refit(older)["status"]
    # Succeeded means serving: the pods it still counts serve its version.
    if kept:
        assert old_st["targetPods"] == old_st["updatedPods"] == len(kept), old_st
        assert "moved on" in old_st["message"], old_st
    else:
        assert "moved on to " + newer in old_st["message"], old_st
    for sim in sims:
        assert_one_driver(sim)
    # Two finished refits never fight over pods: nothing is loaded again while they watch.
    loads = [s.counts()["refit_load"] for s in sims]
    time.sleep(7.0)  # more than one idle tick of both
    assert [s.counts()["refit_load"] for s in sims] == loads
    assert fleet.refit(older)["status"]["phase"] == old_st["phase"]
    assert fleet.refit(newer)["status"]["phase"] == "Succeeded"


def test_pod_held_by_another_refit_waits(harness, sim_fleet, tmp_path):
    """A pod starts matching a running refit while an older refit's pass holds it: the
    running refit says it waits for that pass, then takes the pod once the pass has ended,
    never both at once (claims, not the queue, serialise these two: both already run)."""
    fleet, op = harness
    sims = sim_fleet(3, allowed_root=tmp_path)
    for i in range(2):
        fleet.add_pod(f"pod-{i}", sims[i], labels={"app": "rollout"})
    fleet.add_pod("pod-2", sims[2], labels={"role": "eval"})
    ckpt = make_checkpoints(tmp_path, "va", "vb")
    sims[0].set_fault("refit_load", "delay", 3.0)  # wa runs long on pod-0
    sims[2].set_fault("refit_load", "delay", 3.0)  # wb holds pod-2 for a while
    op.start()
    fleet.apply_refit("wb", "vb", ckpt["vb"], sims[0].port,
                      fleet={"selector": {"matchLabels": {"role": "eval"}}})  # fmt: skip
    fleet.wait_serving(sims[2], "refit_load")
    fleet.apply_refit("wa", "va", ckpt["va"], sims[0].port, strategy={"type": "Rolling",
                      "maxUnavailable": 1})  # fmt: skip
    fleet.wait_serving(sims[0], "refit_load")
    # pod-2 now matches wa too, while wb's pass holds it.
    fleet.core.patch_namespaced_pod("pod-2", fleet.ns, {"metadata": {"labels": {"app": "rollout"}}})

    def waiting() -> bool:
        msg = (fleet.refit("wa").get("status") or {}).get("message", "")
        return "pod-2 held by a pass of refit wb" in msg

    fleet.wait_for(waiting, 30, "wa to say it waits for wb's pass on pod-2")
    st = fleet.wait_phase("wa", END, 90, op)["status"]
    assert st["phase"] == "Succeeded", st
    # wa is newer: once wb's pass ended it refitted pod-2 too; wb's only pod moved on.
    assert st["targetPods"] == st["updatedPods"] == 3, st
    assert sims[2].state()["weight_version"] == "va"
    assert sims[2].counts()["refit_load"] == 2
    fleet.wait_for(
        lambda: (fleet.refit("wb").get("status") or {}).get("phase") == "Superseded", 30,
        "wb to report its pod moved on to wa",
    )  # fmt: skip
    for sim in sims:
        assert_one_driver(sim)


# The simulator endpoint of a step (slowed so the freeze lands inside it), and the call made
# just before it, to tell the probe's completions from the preflight's.
FREEZE_AT = {
    "stage": "refit_stage",  # claimed, the pod still serving
    "load": "refit_load",
    "resetCache": "reset_prefix_cache",
    "probe": "completions",
}
AFTER = {"probe": "weight_info"}


@pytest.mark.failover
@pytest.mark.parametrize("step", sorted(FREEZE_AT))
def test_frozen_leader_is_fenced(harness, sim_fleet, tmp_path, step):
    """The leader freezes (SIGSTOP) inside a step on pod-0 for over three lease durations;
    the standby takes over and re-runs the pass; the old leader is thawed while the new one
    drives the pod. The old leader must not write or call anything after it wakes: it exits,
    the pod sees one driver at a time, and the refit ends Succeeded at the right version."""
    fleet, op = harness
    sims = sim_fleet(2, allowed_root=tmp_path)
    for i, sim in enumerate(sims):
        fleet.add_pod(f"pod-{i}", sim)
    endpoint = FREEZE_AT[step]
    sims[0].set_fault(endpoint, "delay", 2.0)
    ckpt = make_checkpoints(tmp_path, "v1")
    leader = op.start()
    fleet.wait_for(lambda: "acquired" in op.logs(), 30, "the first replica to lead")
    standby = op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port)
    fleet.wait_serving(sims[0], endpoint, after=AFTER.get(step))
    op.freeze(leader)
    frozen_at = time.monotonic()
    old = {c["fence"] for c in fenced_calls(sims[0])}

    def new_pass_on_pod0() -> bool:
        return any(c["fence"] not in old for c in fenced_calls(sims[0]))

    fleet.wait_for(new_pass_on_pod0, 60, "the new leader to drive pod-0")
    time.sleep(max(0.0, 3 * FAILOVER_LEASE_SECONDS - (time.monotonic() - frozen_at)))
    op.thaw(leader)  # the old leader wakes with its pass in mid-step
    st = fleet.wait_phase("wr", END, 90, op)["status"]
    assert st["phase"] == "Succeeded", st
    assert leader.wait(timeout=30) == 1, "the old leader must exit once it may have lost"
    assert standby.poll() is None
    log0 = (op.log_dir / "operator-0.log").read_text()
    assert "may have expired" in log0 or "deadline passed" in log0, log0[-3000:]
    for i, sim in enumerate(sims):
        assert sim.state()["weight_version"] == "v1"
        assert fleet.ready(fleet.pod(f"pod-{i}")) is True
        assert_one_driver(sim, refused_ok=True)
        claim = (fleet.pod(f"pod-{i}")["metadata"].get("annotations") or {}).get(
            "refit.rollout.dev/claim"
        )
        assert claim is None, f"pod-{i} still claimed after its pass: {claim}"
    # No call of the old leader reached pod-0 after the new leader's first one.
    calls = fenced_calls(sims[0])
    first_new = next(i for i, c in enumerate(calls) if c["fence"] not in old)
    late = [c for c in calls[first_new:] if c["fence"] in old and c["status"] != 409]
    assert not late, late


async def _post(url: str, path: str, fence: int) -> int:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + path, headers={contract.FENCE_HEADER: str(fence)}) as r,
    ):
        return r.status


def test_pod_refuses_a_stale_fencing_token(harness, sim_fleet, tmp_path):
    """After a refit, the pod's mark is the pass's token (epoch << 32 | pass): a call with a
    lower one is refused and changes nothing; the operator's own next pass is admitted."""
    import asyncio

    fleet, op = harness
    sims = sim_fleet(1, allowed_root=tmp_path)
    fleet.add_pod("pod-0", sims[0])
    ckpt = make_checkpoints(tmp_path, "v1", "v2")
    op.start()
    fleet.apply_refit("w1", "v1", ckpt["v1"], sims[0].port)
    assert fleet.wait_phase("w1", END, 60, op)["status"]["phase"] == "Succeeded"
    mark = sims[0].state()["fence"]
    assert isinstance(mark, int) and mark > 0
    assert asyncio.run(_post(sims[0].base_url, "/pause", mark - 1)) == 409
    assert sims[0].state()["paused"] is False
    fleet.apply_refit("w2", "v2", ckpt["v2"], sims[0].port)
    assert fleet.wait_phase("w2", END, 60, op)["status"]["phase"] == "Succeeded"
    assert sims[0].state()["fence"] > mark
    assert sims[0].state()["weight_version"] == "v2"


def test_two_installations_never_drive_one_pod_at_once(harness, sim_fleet, tmp_path):
    """Issue 24 #7: two installations (their own Leases, both leading) watch one namespace.
    Their tokens used to start at the same epoch and count passes alike, and each resumed
    the other's pass of the same refit: two loads at once on one pod. Now a pod another live
    operator process claims is left to it, and no two passes share a token."""
    fleet, op = harness
    sims = sim_fleet(3, allowed_root=tmp_path)
    for i, sim in enumerate(sims):
        fleet.add_pod(f"pod-{i}", sim)
        sim.set_fault("refit_load", "delay", 2.0)  # long passes: both operators see them
    ckpt = make_checkpoints(tmp_path, "v1")
    a = op.start("--lease-name", "install-a")
    b = op.start("--lease-name", "install-b")
    fleet.wait_for(lambda: op.logs().count("acquired by") == 2, 30, "both installations to lead")
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port)
    st = fleet.wait_phase("wr", END, 120, op)["status"]
    assert st["phase"] == "Succeeded", st
    assert st["targetPods"] == st["updatedPods"] == 3, st
    for i, sim in enumerate(sims):
        assert sim.counts()["refit_load"] == 1, (i, sim.call_log())
        tokens = {c["fence"] for c in fenced_calls(sim)}
        assert len(tokens) == 1, (i, tokens)  # one pass drove it
        assert_one_driver(sim)
        assert sim.state()["weight_version"] == "v1"
        assert fleet.ready(fleet.pod(f"pod-{i}")) is True
    assert a.poll() is None and b.poll() is None


@pytest.mark.failover
def test_fencing_survives_a_lease_that_starts_over(harness, sim_fleet, tmp_path):
    """Issue 24 #7: a Lease deleted (a reinstall) started the epoch again at 0, below the
    marks the pods kept from the leaders before: every call was StaleFence until the pods
    restarted. Tokens now come from the pods' own resourceVersions."""
    from kubernetes import client as k8s

    fleet, op = harness
    sims = sim_fleet(1, allowed_root=tmp_path)
    fleet.add_pod("pod-0", sims[0])
    ckpt = make_checkpoints(tmp_path, "v1", "v2", "v3")
    first = op.start()
    fleet.apply_refit("w1", "v1", ckpt["v1"], sims[0].port)
    assert fleet.wait_phase("w1", END, 60, op)["status"]["phase"] == "Succeeded"
    op.kill(first)
    second = op.start()  # a new leader of the same Lease (leaseTransitions 1)
    fleet.apply_refit("w2", "v2", ckpt["v2"], sims[0].port)
    assert fleet.wait_phase("w2", END, 60, op)["status"]["phase"] == "Succeeded"
    mark = sims[0].state()["fence"]
    op.kill(second)
    k8s.CoordinationV1Api(fleet.api).delete_namespaced_lease("refit-operator", fleet.ns)
    op.start()  # the Lease starts over
    fleet.apply_refit("w3", "v3", ckpt["v3"], sims[0].port)
    st = fleet.wait_phase("w3", END, 60, op)["status"]
    assert st["phase"] == "Succeeded", st
    assert sims[0].state()["weight_version"] == "v3"
    assert sims[0].state()["fence"] > mark
    assert_one_driver(sims[0])  # no call was refused


def test_pod_replaced_under_its_name_gets_its_own_pass(harness, sim_fleet, tmp_path):
    """Issue 24 #11: a pod deleted mid-pass and created again under its name, at another
    address. The old pass kept calling the old address (here: waiting on a 60 s load) until
    its next pod write, and the new pod waited for it. A pass belongs to one pod object:
    it stops at the next tick, and the new pod gets its own pass at once."""
    fleet, op = harness
    sims = sim_fleet(2, allowed_root=tmp_path)
    fleet.add_pod("pod-0", sims[0])
    sims[0].set_fault("refit_load", "delay", 60.0)
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port)
    fleet.wait_serving(sims[0], "refit_load")
    old_uid = fleet.pod("pod-0")["metadata"]["uid"]
    fleet.core.delete_namespaced_pod("pod-0", fleet.ns, grace_period_seconds=0)

    def deleted() -> bool:
        return all(p["metadata"]["name"] != "pod-0" for p in fleet.pods())

    fleet.wait_for(deleted, 10, "pod-0 to be gone")
    calls_before = len(sims[0].call_log())
    replaced_at = time.monotonic()
    fleet.add_pod("pod-0", sims[1])
    assert fleet.pod("pod-0")["metadata"]["uid"] != old_uid
    fleet.wait_for(lambda: sims[1].counts()["refit_load"] > 0, 15, "the new pod's own pass")
    assert time.monotonic() - replaced_at < 15
    st = fleet.wait_phase("wr", END, 60, op)["status"]
    assert st["phase"] == "Succeeded", st
    assert sims[1].state()["weight_version"] == "v1"
    assert fleet.ready(fleet.pod("pod-0")) is True
    # Nothing reached the old address after the pod it belonged to was replaced.
    assert len(sims[0].call_log()) == calls_before, sims[0].call_log()[calls_before:]
    assert_one_driver(sims[1])
