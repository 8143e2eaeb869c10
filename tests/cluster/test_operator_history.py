"""A long RL run stays flat: finished WeightRefits are collected by the history policy
(`--history-limit`, `spec.ttlSecondsAfterFinished`), the fleet's newest Succeeded refit is
always kept, and a refit created after many collected ones still finds its rollback target."""

from __future__ import annotations

import pytest

from testbed.fleet import make_checkpoints, start_fleet

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def _names(fleet) -> list[str]:
    items = fleet.custom.list_namespaced_custom_object(
        "refit.rollout.dev", "v1alpha1", fleet.ns, "weightrefits"
    )["items"]
    return sorted(i["metadata"]["name"] for i in items)


def test_history_limit_keeps_the_newest_and_the_target(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    versions = [f"s{i}" for i in range(6)]
    ckpt = make_checkpoints(tmp_path, *versions)
    op.start("--history-limit", "2")
    for i, v in enumerate(versions):
        fleet.apply_refit(f"step-{i}", v, ckpt[v], sims[0].port)
        assert (
            fleet.wait_phase(f"step-{i}", {"Succeeded", "Failed", "Halted"}, 60, op)["status"][
                "phase"
            ]
            == "Succeeded"
        )
    fleet.wait_for(lambda: _names(fleet) == ["step-4", "step-5"], 30, "history collected")
    assert all(s.state()["weight_version"] == "s5" for s in sims)
    # The next refit still records the newest Succeeded one as its rollback target.
    fleet.apply_refit("step-6", "s0", ckpt["s0"], sims[0].port)
    st = fleet.wait_phase("step-6", {"Succeeded"}, 60, op)["status"]
    assert st["previous"]["refit"] == "step-5" and st["previous"]["version"] == "s5"
    fleet.wait_for(lambda: _names(fleet) == ["step-5", "step-6"], 30, "history collected")


def test_ttl_after_finished_collects_but_never_the_target(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 1)
    ckpt = make_checkpoints(tmp_path, "v1", "v2")
    op.start()
    fleet.apply_refit("a", "v1", ckpt["v1"], sims[0].port, ttlSecondsAfterFinished=0)
    assert fleet.wait_phase("a", {"Succeeded"}, 60, op)["status"]["phase"] == "Succeeded"
    fleet.apply_refit("b", "v2", ckpt["v2"], sims[0].port, ttlSecondsAfterFinished=0)
    assert fleet.wait_phase("b", {"Succeeded"}, 60, op)["status"]["phase"] == "Succeeded"
    # "a" expired and is not the target any more; "b" is the target: kept despite its TTL.
    fleet.wait_for(lambda: _names(fleet) == ["b"], 30, "the expired refit to be collected")


def test_a_selector_that_varies_by_step_keeps_a_bounded_history(harness, sim_fleet, tmp_path):
    """The refits select the same pods, each with a selector written its own way: they are
    one fleet (as the queue sees them), so history keeps the limit, not one target per text."""
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    versions = [f"s{i}" for i in range(5)]
    ckpt = make_checkpoints(tmp_path, *versions)
    op.start("--history-limit", "2")
    for i, v in enumerate(versions):
        other = {"key": "app", "operator": "NotIn", "values": [f"x{i}"]}
        selector = {"matchLabels": {"app": "rollout"}, "matchExpressions": [other]}
        fleet.apply_refit(f"step-{i}", v, ckpt[v], sims[0].port, fleet={"selector": selector})
        st = fleet.wait_phase(f"step-{i}", {"Succeeded", "Failed", "Halted"}, 60, op)["status"]
        assert st["phase"] == "Succeeded"
        if i:
            assert st["previous"]["refit"] == f"step-{i - 1}"
    fleet.wait_for(lambda: _names(fleet) == ["step-3", "step-4"], 30, "history collected")
    assert all(s.state()["weight_version"] == "s4" for s in sims)
