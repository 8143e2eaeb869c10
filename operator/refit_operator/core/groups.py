"""Pod groups as refit units: a replica that spans several pods (a LeaderWorkerSet group: one
leader serving vLLM's API, worker pods holding the rest of the model) is refitted as one.

With ``spec.fleet.groups`` set, the fleet's pods are grouped by the group label's value, and
each group becomes one ``PodView``: the leader's (index label "0"), whose API every call of
the pass goes to and whose pod carries the pass's claim and record, with what the group as a
whole says about it folded in. The group runs only if every pod runs, is gated (in traffic)
only if every pod's readiness condition is True, its restarts are the sum of every pod's, and
its incarnation names its followers' Pod objects: a restart of any pod, or a follower replaced,
is the group's restart. Its record no longer matches (PodView.same_run), and it is withdrawn
from traffic and refitted again, like a restarted pod. Strategies, status and metrics then
count groups, named by their leaders; the passes write the readiness condition the leader
gets onto every follower too (cluster.ClaimedPod).

A group without exactly one leader, or a pod without the labels, is a fleet problem: its pods
are never called (the preflight refuses the refit; a group that appears later is refused).

Pure: plain data in, plain data out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import replace

from .api import LEADER_INDEX, Groups
from .podview import PodView
from .reasons import Problem, Reason


def units(pods: Sequence[PodView], groups: Groups | None) -> list[PodView]:
    """The fleet's refit units, by name: each pod alone without ``groups``, else one per
    group (its leader's view) and one per pod that carries no group (with its problem)."""
    if groups is None:
        return list(pods)
    out: list[PodView] = []
    members: dict[str, list[PodView]] = {}
    for pod in pods:
        key, index = pod.labels.get(groups.group_label), pod.labels.get(groups.index_label)
        if key is None or index is None:
            missing = groups.group_label if key is None else groups.index_label
            problem = Problem(
                Reason.GroupLabelMissing,
                f"pod {pod.name} has no label {missing} (spec.fleet.groups): it belongs to "
                "no group, and is never refitted alone",
            )
            out.append(replace(pod, group_problem=problem))
            continue
        members.setdefault(key, []).append(pod)
    for key, group in members.items():
        out.append(_unit(key, sorted(group, key=lambda p: p.name), groups))
    return sorted(out, key=lambda p: p.name)


def _unit(key: str, group: list[PodView], groups: Groups) -> PodView:
    leaders = [p for p in group if p.labels[groups.index_label] == LEADER_INDEX]
    followers = tuple(p.name for p in group if p.labels[groups.index_label] != LEADER_INDEX)
    if len(leaders) != 1:
        found = ", ".join(p.name for p in leaders) or "none"
        problem = Problem(
            Reason.GroupLeaderMissing,
            f"group {key} ({', '.join(p.name for p in group)}) has no single leader "
            f"({groups.index_label}={LEADER_INDEX}: {found}): no pod of it is refitted",
        )
        return replace(
            group[0],
            members=tuple(p.name for p in group[1:]),
            group_problem=problem,
            some_ready=any(p.ready for p in group),
        )
    leader = leaders[0]
    return replace(
        leader,
        running=all(p.running for p in group),
        deleting=any(p.deleting for p in group),
        has_gate=all(p.has_gate for p in group),
        ready=all(p.ready for p in group),
        some_ready=any(p.ready for p in group),
        restarts=sum(p.restarts for p in group),
        containers_up=all(p.containers_up for p in group),
        members=followers,
        incarnation=_incarnation(p for p in group if p is not leader),
    )


def _incarnation(followers: Iterable[PodView]) -> str:
    """The followers' Pod objects, as one short digest: a follower deleted and recreated (a
    new uid, its restarts from 0 again) changes it, so the group's record no longer matches."""
    uids = ",".join(sorted(f"{p.name}={p.uid}" for p in followers))
    return hashlib.sha256(uids.encode()).hexdigest()[:16]
