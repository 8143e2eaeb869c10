"""Pod groups as refit units (core/groups.py): LeaderWorkerSet's labels group the fleet's
pods, each group is its leader's view with the group folded in, and a group without its one
leader (or a pod of no group) is refused before any pod is called."""

from __future__ import annotations

from typing import Any

from refit_operator.core.admission import PreflightResult, fleet_problem
from refit_operator.core.api import LWS_GROUP_LABEL, LWS_INDEX_LABEL, Groups, WeightRefitStatus
from refit_operator.core.decision import Decision, decide
from refit_operator.core.groups import units
from refit_operator.core.podflow import Progress
from refit_operator.core.podview import PodView

from tests.fixtures.refits import done, observe, pod, refit, spec

LWS = Groups()
FLEET_WITH_GROUPS = {"selector": {"matchLabels": {"app": "rollout"}}, "groups": {}}


def member(name: str, group: str, index: int, **over: Any) -> PodView:
    labels = {"app": "rollout", LWS_GROUP_LABEL: group, LWS_INDEX_LABEL: str(index)}
    return pod(name, labels=labels, **over)


def test_without_groups_every_pod_is_a_unit() -> None:
    pods = [member("a", "g", 0), member("b", "g", 1)]
    assert units(pods, None) == pods


def test_a_group_is_its_leader_with_the_group_folded_in() -> None:
    pods = [
        member("g1-1", "g1", 1, restarts=2),
        member("g1-0", "g1", 0, restarts=1),
        member("g2-0", "g2", 0),
        member("g2-1", "g2", 1, ready=False),
    ]
    got = {u.name: u for u in units(pods, LWS)}
    assert sorted(got) == ["g1-0", "g2-0"]  # counted as groups, named by their leaders
    g1, g2 = got["g1-0"], got["g2-0"]
    assert (g1.members, g1.restarts, g1.ready, g1.group_problem) == (("g1-1",), 3, True, None)
    assert g1.ip == pods[1].ip  # every call goes to the leader
    assert not g2.ready  # in traffic only when every pod's condition is True


def test_any_pods_restart_is_the_groups_restart() -> None:
    """A pass recorded the group's restarts; a follower's container restart changes them, so
    the group no longer serves what its pass vouched for (it is withdrawn and refitted)."""
    group = units([member("l", "g", 0), member("f", "g", 1)], LWS)[0]
    passed = done(Progress(refit="wr", uid="uid", version="v2", path="/ckpt/v2", restarts=0,
                           incarnation=group.incarnation))  # fmt: skip
    before = units([member("l", "g", 0, progress=passed), member("f", "g", 1)], LWS)[0]
    assert before.serving == "v2"
    after = units([member("l", "g", 0, progress=passed), member("f", "g", 1, restarts=1)], LWS)
    assert after[0].serving == ""


def test_a_replaced_follower_is_the_groups_restart() -> None:
    """A follower deleted and recreated starts its restarts from 0 again: the group's sum may
    not move, but its incarnation (the followers' uids) does."""
    first = units([member("l", "g", 0), member("f", "g", 1, uid="u1")], LWS)[0]
    passed = done(Progress(refit="wr", uid="uid", version="v2", path="/ckpt/v2",
                           incarnation=first.incarnation))  # fmt: skip
    same = units([member("l", "g", 0, progress=passed), member("f", "g", 1, uid="u1")], LWS)
    assert same[0].serving == "v2"
    new = units([member("l", "g", 0, progress=passed), member("f", "g", 1, uid="u2")], LWS)
    assert new[0].restarts == same[0].restarts and new[0].serving == ""
    assert units([member("a", "x", 0)], None)[0].incarnation == ""  # a pod alone: none


def test_a_group_that_is_not_whole_does_not_run() -> None:
    pods = [member("l", "g", 0), member("f", "g", 1, running=False, containers_up=False)]
    (unit,) = units(pods, LWS)
    assert not unit.running and not unit.containers_up and not unit.startable


def test_a_group_without_its_one_leader_is_refused_before_any_pod_is_called() -> None:
    pods = [member("g1-0", "g1", 0), member("g1-1", "g1", 1), member("g2-1", "g2", 1),
            member("g2-2", "g2", 2)]  # fmt: skip
    assert fleet_problem(units(pods, LWS)) is not None  # the preflight then calls no pod
    d = refused(pods)
    ready = next(c for c in d.status.conditions if c.type == "Ready")
    assert ready.reason == "GroupLeaderMissing"
    assert ready.message == (
        f"group g2 (g2-1, g2-2) has no single leader ({LWS_INDEX_LABEL}=0: none): no pod of it "
        "is refitted"
    )
    assert not d.start
    two = [member("a", "g", 0), member("b", "g", 0)]
    assert units(two, LWS)[0].group_problem.message.endswith("=0: a, b): no pod of it is refitted")  # type: ignore[union-attr]


def test_a_pod_without_the_labels_belongs_to_no_group() -> None:
    pods = [member("l", "g", 0), pod("stray", labels={"app": "rollout"})]
    stray = {u.name: u for u in units(pods, LWS)}["stray"]
    assert stray.group_problem is not None
    assert stray.group_problem.reason == "GroupLabelMissing"
    assert LWS_GROUP_LABEL in stray.group_problem.message
    assert refused(pods).status.phase == "Failed"


def test_the_labels_are_configurable() -> None:
    groups = Groups(group_label="replica", index_label="rank")
    pods = [
        pod("x", labels={"replica": "r", "rank": "0"}),
        pod("y", labels={"replica": "r", "rank": "1"}),
    ]
    (unit,) = units(pods, groups)
    assert (unit.name, unit.members) == ("x", ("y",))


def refused(pods: list[PodView]) -> Decision:
    """The preflight's decision on the fleet's units (the engine's Preflight.run returns no
    answers when the Pod objects alone refuse the fleet)."""
    status = WeightRefitStatus(phase="Preflight")
    d = decide(observe(refit(spec(fleet=FLEET_WITH_GROUPS), status), units(pods, LWS),
                       preflight=PreflightResult()))  # fmt: skip
    assert d.status.phase == "Failed"
    return d


def test_the_spec_defaults_to_leaderworkersets_labels() -> None:
    s = spec(fleet=FLEET_WITH_GROUPS)
    assert s.fleet.groups == Groups(group_label=LWS_GROUP_LABEL, index_label=LWS_INDEX_LABEL)
    assert spec().fleet.groups is None
    assert WeightRefitStatus().target_pods == 0
