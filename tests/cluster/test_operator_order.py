"""Newest means creation order, never name order: refits created within one second (the
resolution of creationTimestamp) keep the order they were created in, whoever created them,
whichever way the operator first saw them, and across an operator restart
(docs/concepts.md, "Which refit is newer")."""

from __future__ import annotations

import time

import pytest
from refit_client.client import RefitClient
from refit_operator.core import times

from testbed.fleet import LABELS, make_checkpoints, start_fleet

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

# The client's own default names: refit-step-10 sorts before refit-step-9.
NINE, TEN = "refit-step-9", "refit-step-10"


def in_one_second(fleet, *create) -> None:
    """Run the creations right after a second starts, so they share a creationTimestamp."""
    time.sleep(1.05 - time.time() % 1.0)
    for c in create:
        c()
    made = {fleet.refit(n)["metadata"]["creationTimestamp"] for n in (NINE, TEN)}
    assert len(made) == 1, f"not created in one second: {made}"


def stamp(fleet, name: str) -> str:
    return fleet.refit(name)["metadata"].get("annotations", {}).get(times.CREATED_ANNOTATION, "")


@pytest.mark.parametrize("creator", ["client", "kubectl"])
def test_latest_wins_is_the_refit_created_last_in_the_same_second(
    harness, sim_fleet, tmp_path, control_plane, creator
):
    """The trainer's client stamps its refits; refits created without a stamp get the
    operator's, in the order the watch shows them."""
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    sims[0].fleet.set_fault("refit_load", "delay", 2.0)
    ckpt = make_checkpoints(tmp_path, "v1", "v9", "v10")
    op.start()
    fleet.apply_refit("wr-a", "v1", ckpt["v1"], sims[0].port)
    fleet.wait_phase("wr-a", "Progressing", 30, op)
    with RefitClient(namespace=fleet.ns, kubeconfig=control_plane.kubeconfig) as refits:

        def create(name: str, version: str):
            if creator == "kubectl":
                return lambda: fleet.apply_refit(
                    name, version, ckpt[version], sims[0].port, queuePolicy="LatestWins"
                )
            return lambda: refits.submit(
                ckpt[version], version, fleet_selector=LABELS, name=name,
                port=sims[0].port, queue_policy="LatestWins",
            )  # fmt: skip

        in_one_second(fleet, create(NINE, "v9"), create(TEN, "v10"))
    st = fleet.wait_phase(NINE, "Superseded", 30, op)["status"]
    assert TEN in st["message"]
    fleet.wait_phase(TEN, "Succeeded", 90, op)
    assert all(s.state()["weight_version"] == "v10" for s in sims)
    loads = [c for c in sims[0].call_log() if c["step"] == "refit_load"]
    assert len(loads) == 2  # v1 and v10, never v9
    assert "" < stamp(fleet, NINE) < stamp(fleet, TEN)


@pytest.mark.failover
def test_refits_listed_at_start_keep_their_order_across_a_restart(harness, sim_fleet, tmp_path):
    """Created while no operator runs, the refits reach it by a list (in name order); a later
    write to the older one (a label) makes its resourceVersion the newest. The queue still
    runs them in creation order, before and after an operator restart."""
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    sims[0].fleet.set_fault("refit_load", "delay", 5.0)
    ckpt = make_checkpoints(tmp_path, "v1", "v9", "v10")
    fleet.apply_refit("wr-a", "v1", ckpt["v1"], sims[0].port)
    in_one_second(
        fleet,
        lambda: fleet.apply_refit(NINE, "v9", ckpt["v9"], sims[0].port),
        lambda: fleet.apply_refit(TEN, "v10", ckpt["v10"], sims[0].port),
    )
    first = op.start()
    fleet.wait_phase("wr-a", "Progressing", 30, op)
    assert fleet.wait_phase(NINE, "Queued", 30, op)["status"]["queuePosition"] == 1
    assert fleet.wait_phase(TEN, "Queued", 30, op)["status"]["queuePosition"] == 2
    stamps = stamp(fleet, NINE), stamp(fleet, TEN)
    assert "" < stamps[0] < stamps[1]
    op.kill(first)
    fleet.custom.patch_namespaced_custom_object(
        "refit.rollout.dev", "v1alpha1", fleet.ns, "weightrefits", NINE,
        {"metadata": {"labels": {"touched": "after-creation"}}},
    )  # fmt: skip
    op.start()
    fleet.wait_phase(NINE, "Succeeded", 90, op)
    st = fleet.wait_phase(TEN, "Succeeded", 90, op)["status"]
    assert st["previous"]["refit"] == NINE
    assert all(s.state()["weight_version"] == "v10" for s in sims)
    assert (stamp(fleet, NINE), stamp(fleet, TEN)) == stamps  # stamped once
