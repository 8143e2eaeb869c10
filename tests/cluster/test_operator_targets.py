"""Each pod has one target, the newest Succeeded refit that selects it now, on the real API
server with the real operator process and simulated workers: a pod relabelled into another
fleet, a rollback across two tiers, a container that restarts after a newer refit halted or
was deleted (docs/concepts.md, "Convergence" and "Rollback")."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from refit_client.refit_document import build_refit

from testbed.fleet import Fleet, make_checkpoints

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

END = {"Succeeded", "Failed", "Halted", "RolledBack"}
# Well below the 60 s a finished refit that is nobody's target waits between its ticks: what
# must happen here is the target's work, not a dormant refit's.
PROMPTLY = 20


def apply(fleet: Fleet, name: str, version: str, path: Path, labels: dict[str, str], port: int,
          **spec: Any) -> None:  # fmt: skip
    body = build_refit(name, str(path), version, fleet_selector=labels, port=port, spec_fields=spec)
    fleet.custom.create_namespaced_custom_object(
        "refit.rollout.dev", "v1alpha1", fleet.ns, "weightrefits", body
    )


def serves(fleet: Fleet, sim: Any, name: str, version: str) -> bool:
    return bool(sim.state()["weight_version"] == version and fleet.ready(fleet.pod(name)))


def test_a_pod_relabelled_into_another_fleet_is_refitted_to_that_fleets_target(
    harness, sim_fleet, tmp_path
):
    """The rollout pool serves the policy, the reference pool the frozen base. A rollout pod
    relabelled into the reference pool must serve the base (its KL terms are computed on it),
    not keep the policy: out of traffic at once, refitted by the reference refit, probed."""
    fleet, op = harness
    sims = sim_fleet(3, allowed_root=tmp_path)
    ref, gen = {"pool": "reference"}, {"pool": "rollout"}
    fleet.add_pod("ref-0", sims[0], labels=ref)
    fleet.add_pod("gen-0", sims[1], labels=gen)
    fleet.add_pod("gen-1", sims[2], labels=gen)
    ckpt = make_checkpoints(tmp_path, "base", "policy")
    op.start()
    port = sims[0].port
    apply(fleet, "base", "base", ckpt["base"], ref, port)
    assert fleet.wait_phase("base", END, 60, op)["status"]["phase"] == "Succeeded"
    apply(fleet, "policy", "policy", ckpt["policy"], gen, port)
    assert fleet.wait_phase("policy", END, 60, op)["status"]["phase"] == "Succeeded"
    assert serves(fleet, sims[2], "gen-1", "policy")
    fleet.core.patch_namespaced_pod("gen-1", fleet.ns, {"metadata": {"labels": ref}})
    fleet.wait_for(lambda: serves(fleet, sims[2], "gen-1", "base"), PROMPTLY, "gen-1 at base")
    record = fleet.progress(fleet.pod("gen-1"))
    assert record is not None and (record["refit"], record["version"]) == ("base", "base")
    assert record["probe"]["verdict"] == "Pass"
    # It served another fleet's weights: not kept serving them while the base staged.
    assert record["serving"] == "" and record["left_traffic"] == record["started"]

    def counted() -> bool:
        st = fleet.refit("base")["status"]
        return bool(st["message"] == "2/2 pods at base" and st["updatedPods"] == 2)

    fleet.wait_for(counted, 15, "the base refit to count the moved pod")
    fleet.wait_for(lambda: fleet.refit("policy")["status"]["targetPods"] == 1, 15, "policy")
    assert fleet.refit("policy")["status"]["message"] == "1/1 pods at policy"
    assert serves(fleet, sims[1], "gen-0", "policy")


def test_a_rollback_returns_each_tier_to_the_checkpoint_it_served(harness, sim_fleet, tmp_path):
    """An app-wide refit (a1), then the gen tier alone (g1), then an app-wide refit (a2) that
    fails on an eval pod and rolls back: the gen pods go back to g1, the eval pods to a1 (the
    checkpoint each served), never to g1, which the eval tier never served."""
    fleet, op = harness
    sims = sim_fleet(4, allowed_root=tmp_path)
    names = ["eval-0", "eval-1", "gen-0", "gen-1"]
    for name, sim in zip(names, sims, strict=True):
        fleet.add_pod(name, sim, labels={"app": "rollout", "tier": name.split("-")[0]})
    ckpt = make_checkpoints(tmp_path, "a1", "g1", "a2")
    op.start()
    port = sims[0].port
    app, tier = {"app": "rollout"}, {"tier": "gen"}
    apply(fleet, "app-1", "a1", ckpt["a1"], app, port)
    assert fleet.wait_phase("app-1", END, 60, op)["status"]["phase"] == "Succeeded"
    apply(fleet, "gen-1", "g1", ckpt["g1"], tier, port)
    assert fleet.wait_phase("gen-1", END, 60, op)["status"]["phase"] == "Succeeded"
    sims[1].set_fault("completions", "drift", -1.0, times=1)  # eval-1's probe of a2
    # Created in a later second than gen-1 (the order of same-second refits is another fix's).
    time.sleep(1.1)
    apply(fleet, "app-2", "a2", ckpt["a2"], app, port, onFailure="Rollback")
    st = fleet.wait_phase("app-2", {"RolledBack", "Failed", "Halted", "Succeeded"}, 90, op)
    st = st["status"]
    assert st["phase"] == "RolledBack", st
    assert "2 pods rolled back to a1 (eval-0, eval-1)" in st["message"], st["message"]
    assert "2 pods rolled back to g1 (gen-0, gen-1)" in st["message"], st["message"]
    uid = fleet.refit("app-2")["metadata"]["uid"]
    want = {"eval-0": "a1", "eval-1": "a1", "gen-0": "g1", "gen-1": "g1"}
    for (name, version), sim in zip(want.items(), sims, strict=True):
        assert serves(fleet, sim, name, version), (name, sim.state())
        record = fleet.progress(fleet.pod(name))
        assert record is not None and record["uid"] == uid and record["rollback"] is True
        assert (record["version"], record["path"]) == (version, str(ckpt[version]))
        assert record["outcome"] == "Succeeded"
        loads = [c["params"] for c in sim.call_log() if c["step"] == "refit_load"]
        assert str(ckpt["g1"]) not in str(loads) or version == "g1", (name, loads)


def test_a_restarted_pod_after_a_newer_refit_halted_is_converged_by_its_target(
    harness, sim_fleet, tmp_path
):
    """v2 halts with pod-0 passed (it keeps v2) and pod-1 failed (out of traffic). pod-0's
    container restarts: the fleet's target (v1, the newest Succeeded refit) takes it out of
    traffic and refits it to v1 at once, not a dormant tick later, and not never."""
    fleet, op = harness
    sims = sim_fleet(2, allowed_root=tmp_path)
    for i, sim in enumerate(sims):
        fleet.add_pod(f"pod-{i}", sim)
    ckpt = make_checkpoints(tmp_path, "v1", "v2")
    op.start()
    port = sims[0].port
    app = {"app": "rollout"}
    apply(fleet, "wr-1", "v1", ckpt["v1"], app, port)
    assert fleet.wait_phase("wr-1", END, 60, op)["status"]["phase"] == "Succeeded"
    sims[1].set_fault("completions", "drift", -1.0, times=1)
    apply(fleet, "wr-2", "v2", ckpt["v2"], app, port)
    assert fleet.wait_phase("wr-2", END, 60, op)["status"]["phase"] == "Halted"
    assert serves(fleet, sims[0], "pod-0", "v2")
    sims[0].restart()
    fleet.restart_container("pod-0")
    fleet.wait_for(lambda: serves(fleet, sims[0], "pod-0", "v1"), PROMPTLY, "pod-0 at v1")
    record = fleet.progress(fleet.pod("pod-0"))
    assert record is not None and (record["refit"], record["version"]) == ("wr-1", "v1")
    # Halt: the failed pod stays out of traffic with its reason.
    assert fleet.ready(fleet.pod("pod-1")) is False

    def counted() -> bool:
        return bool(fleet.refit("wr-1")["status"]["message"].startswith("1/1 pods at v1"))

    fleet.wait_for(counted, 15, "wr-1 to count pod-0")


def test_a_restarted_pod_after_the_target_was_deleted_is_converged_by_the_refit_before(
    harness, sim_fleet, tmp_path
):
    """v2 Succeeded on every pod (v1: Superseded, PodsMovedOn), then v2 was deleted. A pod
    that keeps v2 serves on; one whose container restarts is converged by v1, the newest
    refit the fleet served that is left, which is Succeeded (and the target) again."""
    fleet, op = harness
    sims = sim_fleet(2, allowed_root=tmp_path)
    for i, sim in enumerate(sims):
        fleet.add_pod(f"pod-{i}", sim)
    ckpt = make_checkpoints(tmp_path, "v1", "v2")
    op.start()
    port = sims[0].port
    app = {"app": "rollout"}
    apply(fleet, "wr-1", "v1", ckpt["v1"], app, port)
    assert fleet.wait_phase("wr-1", END, 60, op)["status"]["phase"] == "Succeeded"
    apply(fleet, "wr-2", "v2", ckpt["v2"], app, port)
    assert fleet.wait_phase("wr-2", END, 60, op)["status"]["phase"] == "Succeeded"
    fleet.wait_phase("wr-1", "Superseded", 30, op)
    fleet.custom.delete_namespaced_custom_object(
        "refit.rollout.dev", "v1alpha1", fleet.ns, "weightrefits", "wr-2"
    )

    def deleted() -> bool:
        items = fleet.custom.list_namespaced_custom_object(
            "refit.rollout.dev", "v1alpha1", fleet.ns, "weightrefits"
        )["items"]
        return [i["metadata"]["name"] for i in items] == ["wr-1"]

    fleet.wait_for(deleted, 30, "wr-2 to be deleted")
    sims[1].restart()
    fleet.restart_container("pod-1")
    fleet.wait_for(lambda: serves(fleet, sims[1], "pod-1", "v1"), PROMPTLY, "pod-1 at v1")
    st = fleet.wait_phase("wr-1", "Succeeded", 15, op)["status"]
    assert {c["type"]: c["status"] for c in st["conditions"]}["Ready"] == "True"
    assert serves(fleet, sims[0], "pod-0", "v2")  # intact: what the deleted refit left stands
