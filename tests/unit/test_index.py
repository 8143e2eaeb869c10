"""The engine's index of WeightRefits (refit_operator.core.index), with plain documents."""

from __future__ import annotations

from typing import Any

from refit_operator.core import history, plan, times
from refit_operator.core.index import RefitIndex
from refit_operator.core.podview import PodView


def doc(name: str, created: str, phase: str, selector: dict[str, Any], **meta: Any) -> dict:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}",
                     "creationTimestamp": created, **meta},
        "spec": {"fleet": {"selector": selector},
                 "checkpoint": {"path": f"/c/{name}", "version": f"v-{name}"}},
        "status": {"phase": phase, "completionTime": "2026-01-01T00:00:00Z"},
    }  # fmt: skip


def pod(name: str, **labels: str) -> PodView:
    return PodView(name, "127.0.0.2", True, True, False, True, 0, None, labels=labels)


def test_refits_share_a_fleet_by_the_pods_they_select_not_by_selector_text() -> None:
    idx = RefitIndex()
    idx.observe(doc("a", "2026-01-01T00:00:01Z", "Succeeded", {"matchLabels": {"app": "r"}}))
    tier = {"matchExpressions": [{"key": "tier", "operator": "Exists"}]}
    idx.observe(doc("b", "2026-01-01T00:00:02Z", "Succeeded", tier))
    idx.observe(doc("other", "2026-01-01T00:00:03Z", "Progressing", {"matchLabels": {"x": "y"}}))
    idx.observe(doc("me", "2026-01-01T00:00:04Z", "Pending", {"matchLabels": {"tier": "g"}}))
    pods = [pod("p0", app="r", tier="g")]
    refs, previous = idx.sharing("ns", "u-me", "2026-01-01T00:00:04Z", "Preflight", pods)
    assert sorted((r.name, r.phase) for r in refs) == [
        ("a", "Succeeded"), ("b", "Succeeded"), ("me", "Preflight"),
    ]  # fmt: skip
    assert previous is not None and previous.refit == "b" and previous.version == "v-b"
    assert idx.to_wake("ns", refs, "u-me") == ["u-a", "u-b"]


def test_a_finish_wakes_the_queued_refits_and_the_previous_target_not_the_history() -> None:
    idx = RefitIndex()
    sel = {"matchLabels": {"app": "r"}}
    for i in range(3):  # the history: each moved on from by the next
        idx.observe(doc(f"s{i}", f"2026-01-01T00:00:0{i}Z", "Succeeded", sel))
    idx.observe(doc("me", "2026-01-01T00:00:05Z", "Succeeded", sel))
    idx.observe(doc("next", "2026-01-01T00:00:06Z", "Pending", sel))
    refs = [idx.known[f"u-{n}"].ref() for n in ("s0", "s1", "s2", "me", "next")]
    assert sorted(idx.to_wake("ns", refs, "u-me")) == ["u-next", "u-s2"]


def test_deleted_refits_leave_the_index_and_collection_asks_once() -> None:
    idx = RefitIndex()
    sel = {"matchLabels": {"app": "r"}}
    for i in range(4):
        idx.observe(doc(f"s{i}", f"2026-01-01T00:00:0{i}Z", "Succeeded", sel))
    policy = history.Policy(history_limit=2)
    first = idx.to_collect("ns", policy, now=1e10)
    assert [k.name for k in first] == ["s0", "s1"]
    assert idx.to_collect("ns", policy, now=1e10) == []  # asked already: not again
    gone = idx.observe(doc("s0", "2026-01-01T00:00:00Z", "Succeeded", sel), deleted=True)
    assert gone is not None and gone.name == "s0"
    assert sorted(idx.names("ns").values()) == ["s1", "s2", "s3"]


def broadcast_doc(name: str, created: str, phase: str, selector: dict[str, Any]) -> dict:
    d = doc(name, created, phase, selector)
    del d["spec"]["checkpoint"]
    d["spec"]["broadcast"] = {
        "version": f"v-{name}",
        "rendezvous": {"host": "10.0.0.5", "port": 29500},
        "manifest": {"configMapRef": {"name": "m"}, "digest": "a" * 64},
    }
    return d


def index_of(*docs: dict) -> RefitIndex:
    idx = RefitIndex()
    for d in docs:
        idx.observe(d)
    return idx


APP_R = {"matchLabels": {"app": "r"}}


def test_the_rollback_target_is_the_newest_succeeded_checkpoint_not_a_broadcast() -> None:
    idx = index_of(
        doc("a", "2026-01-01T00:00:01Z", "Succeeded", APP_R),
        broadcast_doc("b", "2026-01-01T00:00:02Z", "Succeeded", APP_R),
        broadcast_doc("c", "2026-01-01T00:00:03Z", "Succeeded", APP_R),
    )
    pods = [pod("p0", app="r")]
    refs, previous = idx.sharing("ns", "u-me", "2026-01-01T00:00:04Z", "Preflight", pods)
    # The broadcasts share the fleet (they queue and wake as any refit) ...
    assert {r.name for r in refs} == {"a", "b", "c"}
    # ... but only a checkpoint can be loaded again.
    assert previous is not None and previous.refit == "a"
    assert (previous.version, previous.path) == ("v-a", "/c/a")
    # A fleet that only ever received broadcasts has nothing to roll back to.
    idx.observe(doc("a", "2026-01-01T00:00:01Z", "Succeeded", APP_R), deleted=True)
    assert idx.sharing("ns", "u-me", "2026-01-01T00:00:04Z", "Preflight", pods)[1] is None


def test_collection_keeps_the_rollback_target_behind_a_broadcast_target() -> None:
    idx = index_of(
        doc("s0", "2026-01-01T00:00:00Z", "Succeeded", APP_R),
        doc("s1", "2026-01-01T00:00:01Z", "Succeeded", APP_R),
        broadcast_doc("s2", "2026-01-01T00:00:02Z", "Succeeded", APP_R),
    )
    collected = idx.to_collect("ns", history.Policy(history_limit=0), now=1e10)
    assert [k.name for k in collected] == ["s0"]


# --- creation order within one second -----------------------------------------------------

SECOND = "2026-01-01T00:00:05Z"


def stamped(name: str, ns: int, phase: str = "Pending", **spec: Any) -> dict:
    d = doc(name, SECOND, phase, APP_R, annotations={times.CREATED_ANNOTATION: times.stamp(ns)})
    d["spec"].update(spec)
    return d


def queue(idx: RefitIndex, name: str) -> plan.QueueDecision:
    refs, _ = idx.sharing("ns", f"u-{name}", idx.known[f"u-{name}"].created, "Pending",
                          [pod("p0", app="r")])  # fmt: skip
    me = next(r for r in refs if r.name == name)
    return plan.queue_role(me, refs)


def test_refits_of_one_second_are_ordered_by_their_stamps_not_their_names() -> None:
    # The client's default names: refit-step-10 sorts before refit-step-9.
    nine = stamped("refit-step-9", 1_767_225_605_100000000, queuePolicy="LatestWins")
    ten = stamped("refit-step-10", 1_767_225_605_200000000, queuePolicy="LatestWins")
    for docs in ((nine, ten), (ten, nine)):  # either order of arrival
        idx = index_of(*docs)
        assert queue(idx, "refit-step-9").superseded_by == "refit-step-10"
        assert queue(idx, "refit-step-10").role == "active"
    done = index_of(
        stamped("refit-step-9", 1_767_225_605_100000000, "Succeeded"),
        stamped("refit-step-10", 1_767_225_605_200000000, "Succeeded"),
    )
    refs, previous = done.sharing("ns", "u-me", "2026-01-01T00:00:06Z", "Pending",
                                  [pod("p0", app="r")])  # fmt: skip
    assert plan.fleet_target(refs) == "refit-step-10"
    assert previous is not None and previous.refit == "refit-step-10"
    policy = history.Policy(history_limit=1)
    assert [k.name for k in done.to_collect("ns", policy, now=1e10)] == ["refit-step-9"]


def test_a_refit_without_a_stamp_gets_one_at_first_sight_and_keeps_it() -> None:
    nine, ten = (doc(n, SECOND, "Pending", APP_R) for n in ("refit-step-9", "refit-step-10"))
    first, second = times.stamp(1_767_225_605_300000000), times.stamp(1_767_225_605_300000001)
    for a, b in ((nine, ten), (ten, nine)):  # the watch shows them in the order they were stored
        idx = RefitIndex()
        idx.observe(a, stamp=first)
        idx.observe(b, stamp=second)
        older, newer = idx.known[a["metadata"]["uid"]], idx.known[b["metadata"]["uid"]]
        assert (older.stamp, newer.stamp) == (first, second)
        assert times.order_key(older.created, older.name) < times.order_key(
            newer.created, newer.name
        )
        # Seen again (a status write, a tick's read) before the stamp is on the object: the
        # order it was given stays; the one offered now is not taken.
        idx.observe(a, stamp=times.stamp(1_767_225_699_000000000))
        assert idx.known[a["metadata"]["uid"]].stamp == first
        assert idx.unstamped(a["metadata"]["uid"]) is not None
        idx.stamped(a["metadata"]["uid"], first)
        assert idx.unstamped(a["metadata"]["uid"]) is None
    # A stamp on the object (the client's, or one written before a restart) is the order.
    idx = RefitIndex()
    carried = stamped("refit-step-9", 1_767_225_605_100000000)
    idx.observe(carried, stamp=second)
    k = idx.known["u-refit-step-9"]
    assert k.stamp == times.stamp(1_767_225_605_100000000) and k.stamped
    assert idx.order("u-refit-step-9", {}) == k.created


def test_collection_groups_refits_by_the_pods_they_select_not_by_selector_text() -> None:
    pods = [pod("p0", app="r", tier="g"), pod("p1", app="r", tier="g")]
    selectors: list[dict[str, Any]] = [
        {"matchLabels": {"app": "r"}},
        {"matchLabels": {"tier": "g"}},
        {"matchExpressions": [{"key": "app", "operator": "In", "values": ["r", "x"]}]},
        {"matchLabels": {"app": "r", "tier": "g"}},
    ]
    docs = [doc(f"s{i}", f"2026-01-01T00:00:0{i}Z", "Succeeded", sel)
            for i, sel in enumerate(selectors)]  # fmt: skip
    policy = history.Policy(history_limit=2)
    collected = index_of(*docs).to_collect("ns", policy, now=1e10, pods=pods)
    assert [k.name for k in collected] == ["s0", "s1"]
    # Without pods to compare by (none selected now), each selector text is a fleet of its own.
    assert index_of(*docs).to_collect("ns", policy, now=1e10) == []


# --- a missed DELETED event ------------------------------------------------------------------


def test_a_refit_the_api_server_no_longer_has_is_dropped_and_unblocks_its_fleet() -> None:
    idx = index_of(doc("ghost", "2026-01-01T00:00:01Z", "Progressing", APP_R))
    idx.observe(doc("b", "2026-01-01T00:00:02Z", "Pending", APP_R))
    idx.observe(doc("other", "2026-01-01T00:00:03Z", "Progressing", APP_R) | {
        "metadata": {"name": "other", "namespace": "ns2", "uid": "u-other",
                     "creationTimestamp": "2026-01-01T00:00:03Z"}})  # fmt: skip
    # The ghost's DELETED event was lost: b waits for it, and its claims look live.
    assert queue(idx, "b").waiting_for == "ghost"
    assert "u-ghost" in idx.names("ns")
    since = idx.seq
    # Created (and seen through the watch) while the list was on its way: not in the list,
    # but newer than it, so it stays.
    idx.observe(doc("late", "2026-01-01T00:00:04Z", "Pending", APP_R))
    gone = idx.drop_missing("ns", {"u-b"}, since)
    assert [k.name for k in gone] == ["ghost"]
    assert sorted(idx.names("ns").values()) == ["b", "late"]
    assert "u-other" in idx.known  # another namespace's refits are not this list's to judge
    assert queue(idx, "b").role == "active"
    assert "u-ghost" not in idx.first_seen  # nothing kept for it
    # Only the refit asked about, when a read of one name finds nothing.
    assert idx.drop_missing("ns", set(), idx.seq, "late")[0].name == "late"
    assert sorted(idx.names("ns").values()) == ["b"]
