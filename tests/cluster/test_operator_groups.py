"""Replicas that span several pods (spec.fleet.groups; core/groups.py), on the real API server
with simulated workers: pods labelled as LeaderWorkerSet labels them (the LWS controller is not
served by this project's registries, so the tests register the pods it would make). Each group
is one refit unit: only its leader's API is called, every pod of it is gated on the group's
probe, a restart of a follower is the group's restart, and a group without its leader is
refused before any pod is called."""

from __future__ import annotations

import time
from typing import Any

import pytest
from refit_operator.core.api import LWS_GROUP_LABEL, LWS_INDEX_LABEL

from testbed.fleet import LABELS, make_checkpoints

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

END = {"Succeeded", "Failed", "Halted", "RolledBack"}
GROUPS: dict[str, Any] = {"groups": {}}  # spec.fleet.groups with LeaderWorkerSet's labels


def add_group(fleet: Any, sims: list[Any], key: str, indices: list[int]) -> None:
    """Pods ``<key>-<index>`` of one group, each on a simulated worker of its own (a follower's
    must never be called)."""
    for index, sim in zip(indices, sims, strict=True):
        labels = {**LABELS, LWS_GROUP_LABEL: key, LWS_INDEX_LABEL: str(index)}
        fleet.add_pod(f"{key}-{index}", sim, labels=labels)


def test_a_group_is_refitted_through_its_leader_and_gated_as_one(harness, sim_fleet, tmp_path):
    fleet, op = harness
    sims = sim_fleet(4, allowed_root=tmp_path)
    add_group(fleet, sims[0:2], "g1", [0, 1])
    add_group(fleet, sims[2:4], "g2", [0, 1])
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port, fleet=GROUPS,
                      strategy={"type": "Rolling", "maxUnavailable": 1})  # fmt: skip
    st = fleet.wait_phase("wr", END, 120, op)["status"]
    assert st["phase"] == "Succeeded", st
    assert st["targetPods"] == 2  # groups, not pods
    names = ["g1-0", "g1-1", "g2-0", "g2-1"]
    assert {n: fleet.ready(fleet.pod(n)) for n in names} == dict.fromkeys(names, True)
    assert sims[0].counts()["refit_load"] == sims[2].counts()["refit_load"] == 1
    assert sims[1].calls() == [] and sims[3].calls() == []  # followers: never called
    for follower in ("g1-1", "g2-1"):  # the record and the claim live on the leader only
        assert fleet.progress(fleet.pod(follower)) is None

    # A follower's container restarts: the group's restart. The group leaves traffic, is
    # refitted again through its leader and probed, and comes back as one (a simulated pass
    # takes milliseconds: the leader's record says when the group left and came back).
    restarted = time.time()
    fleet.restart_container("g1-1")
    fleet.wait_for(
        lambda: (
            sims[0].counts().get("refit_load", 0) == 2
            and (fleet.progress(fleet.pod("g1-0")) or {}).get("outcome") == "Succeeded"
        ),
        60,
        "g1 refitted again",
    )
    record = fleet.progress(fleet.pod("g1-0"))
    assert record is not None and record["restarts"] == 1  # the group's: g1-1's restart
    assert record["left_traffic"] >= restarted and record["finished"] >= record["left_traffic"]
    assert fleet.ready(fleet.pod("g1-0")) is True and fleet.ready(fleet.pod("g1-1")) is True
    # A follower replaced by a new Pod (which starts without the condition): the group is not
    # in traffic as a whole, so it is refitted again too, and the new follower gated with it.
    fleet.core.delete_namespaced_pod("g2-1", fleet.ns, grace_period_seconds=0)
    fleet.wait_for(lambda: "g2-1" not in {p["metadata"]["name"] for p in fleet.pods()}, 30, "gone")
    add_group(fleet, sims[3:4], "g2", [1])
    fleet.wait_for(
        lambda: (
            sims[2].counts().get("refit_load", 0) == 2
            and fleet.ready(fleet.pod("g2-0")) is True
            and fleet.ready(fleet.pod("g2-1")) is True
        ),
        60,
        "g2 refitted again with its new follower",
    )
    assert sims[1].calls() == [] and sims[3].calls() == []
    assert sims[0].counts()["refit_load"] == 2  # g1 was left alone


def test_a_group_without_its_leader_is_refused_before_any_pod_is_called(
    harness, sim_fleet, tmp_path
):
    fleet, op = harness
    sims = sim_fleet(4, allowed_root=tmp_path)
    add_group(fleet, sims[0:2], "g1", [0, 1])
    add_group(fleet, sims[2:4], "g2", [1, 2])  # its leader is being recreated, say
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port, fleet=GROUPS)
    st = fleet.wait_phase("wr", END, 60, op)["status"]
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert (st["phase"], ready["reason"]) == ("Failed", "GroupLeaderMissing"), st
    assert "group g2 (g2-1, g2-2) has no single leader" in ready["message"]
    assert all(s.calls() == [] for s in sims)  # not even refit_info
