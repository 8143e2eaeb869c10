"""leader.py without an API server: expiry judged on this process's own clock (client-go's
rule), never on the holder's renewTime; and whether a claim's holder may still act."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException
from refit_operator.core.times import rfc3339_micro
from refit_operator.edges import leader
from refit_operator.edges.leader import Lease, Observer, holder_alive

DAY = 86_400.0


class _Resp:
    def __init__(self, status: int, doc: Any) -> None:
        self.status, self._body = status, json.dumps(doc).encode()

    async def read(self) -> bytes:
        return self._body


class FakeLeases:
    """CoordinationV1Api's Lease calls over a dict, with resourceVersions and conflicts."""

    def __init__(self) -> None:
        self.docs: dict[tuple[str, str], dict[str, Any]] = {}
        self.rv = 100
        self.forbidden: set[tuple[str, str]] = set()

    def put(self, ns: str, name: str, spec: dict[str, Any]) -> None:
        self.rv += 1
        meta = {"name": name, "namespace": ns, "resourceVersion": str(self.rv)}
        self.docs[(ns, name)] = {"metadata": meta, "spec": spec}

    async def read_namespaced_lease(self, name: str, ns: str, **_: Any) -> _Resp:
        if (ns, name) in self.forbidden:
            raise ApiException(status=403, reason="Forbidden")
        doc = self.docs.get((ns, name))
        return _Resp(200, doc) if doc else _Resp(404, {"reason": "NotFound"})

    async def create_namespaced_lease(self, ns: str, body: dict[str, Any]) -> None:
        if (ns, body["metadata"]["name"]) in self.docs:
            raise ApiException(status=409, reason="AlreadyExists")
        self.put(ns, body["metadata"]["name"], body["spec"])

    async def replace_namespaced_lease(self, name: str, ns: str, body: dict[str, Any]) -> None:
        if (
            body["metadata"]["resourceVersion"]
            != self.docs[(ns, name)]["metadata"]["resourceVersion"]
        ):
            raise ApiException(status=409, reason="Conflict")
        self.put(ns, name, body["spec"])


class Clock:
    def __init__(self) -> None:
        self.mono = 1000.0

    def __call__(self) -> float:
        return self.mono


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(leader.times, "monotonic", c)
    return c


def standby(api: FakeLeases, identity: str = "standby") -> Lease:
    lease = Lease(object(), "ns", "refit-operator", identity, 10)  # type: ignore[arg-type]
    lease.api = api
    return lease


def held_by(api: FakeLeases, holder: str, renewed: float) -> None:
    api.put("ns", "refit-operator", {
        "holderIdentity": holder, "leaseDurationSeconds": 10, "leaseTransitions": 4,
        "renewTime": rfc3339_micro(renewed), "acquireTime": rfc3339_micro(renewed),
    })  # fmt: skip


async def test_a_live_holder_whose_clock_is_far_behind_keeps_the_lease(clock: Clock) -> None:
    """Issue 24 #10: the standby judged renewTime (the holder's wall clock) against its own
    clock. A holder a day behind looked expired on every look, and the standby took a Lease
    that was being renewed. Judged by its own clock, the record changes: no expiry."""
    import time

    api = FakeLeases()
    me = standby(api)
    for _ in range(20):  # the holder renews every 2 s, its renewTime a day in the past
        held_by(api, "leader", time.time() - DAY)
        assert not await me.try_acquire()
        clock.mono += 2.0
    assert api.docs[("ns", "refit-operator")]["spec"]["holderIdentity"] == "leader"
    # It stops renewing (last seen 2 s ago): taken once this process saw no change for a
    # lease duration.
    clock.mono += 7.9
    assert not await me.try_acquire()
    clock.mono += 0.2
    assert await me.try_acquire()
    assert api.docs[("ns", "refit-operator")]["spec"]["holderIdentity"] == "standby"


async def test_a_dead_holder_whose_clock_is_far_ahead_loses_the_lease(clock: Clock) -> None:
    """A holder a day ahead left renewTime in the future: judged by it, the Lease never
    expired and the fleet had no leader for a day. By this process's clock: one duration."""
    import time

    api = FakeLeases()
    held_by(api, "leader", time.time() + DAY)
    me = standby(api)
    assert not await me.try_acquire()
    clock.mono += 10.5
    assert await me.try_acquire()


async def test_a_new_standby_waits_a_full_duration_even_for_an_old_renew_time(
    clock: Clock,
) -> None:
    """What it has not seen change, it has not seen expire: a renewTime an hour old proves
    nothing about a holder whose clock may be an hour slow."""
    import time

    api = FakeLeases()
    held_by(api, "leader", time.time() - 3600)
    me = standby(api)
    assert not await me.try_acquire()
    clock.mono += 5.0
    assert not await me.try_acquire()
    clock.mono += 5.0
    assert await me.try_acquire()


def test_holder_alive_rules() -> None:
    spec = {"holderIdentity": "a", "leaseDurationSeconds": 15}
    assert holder_alive(spec, "a", 14.9, 99)  # the Lease's own duration wins
    assert not holder_alive(spec, "a", 15.0, 99)
    assert not holder_alive(spec, "b", 0.0, 99)  # someone else took it: b waited it out
    assert not holder_alive({"holderIdentity": ""}, "a", 0.0, 15)  # released
    assert holder_alive(None, "a", 14.0, 15)  # absent: a live holder re-creates it
    assert not holder_alive(None, "a", 15.0, 15)


def test_observer_counts_from_the_change_it_saw() -> None:
    o = Observer()
    assert o.unchanged_for(("n", "l"), "5", 100.0) == 0.0
    assert o.unchanged_for(("n", "l"), "5", 107.0) == 7.0
    assert o.unchanged_for(("n", "l"), "6", 108.0) == 0.0
    assert o.unchanged_for(("n", "l"), None, 109.0) == 0.0  # deleted: a change too
    assert o.unchanged_for(("n", "l"), None, 120.0) == 11.0
    # Leases no longer looked at are forgotten: nothing grows with the Leases ever seen.
    for i in range(50):
        o.unchanged_for(("n", f"x{i}"), "1", 200.0)
    o.unchanged_for(("n", "l"), None, 200.0 + Observer.FORGET_SECONDS + 1)
    assert len(o._seen) == 1


async def test_holders_of_claims_are_judged_by_their_own_lease(clock: Clock) -> None:
    """A claim names its holder's Lease: another installation's holder is alive while its
    Lease changes; dead once another identity holds it, once it has gone a duration without
    a change, or once it has been absent for the claim's duration. An unreadable Lease
    proves nothing: its holder counts as alive."""
    api = FakeLeases()
    me = standby(api, "me")
    api.put("other", "op-b", {"holderIdentity": "b1", "leaseDurationSeconds": 30})
    api.forbidden.add(("locked", "op-c"))
    claims = {
        ("other/op-b", "b1", 30),  # alive
        ("other/op-b", "b0", 30),  # an earlier holder of that Lease: dead
        ("gone/op-d", "d1", 20),  # no such Lease (yet): alive until 20 s of absence
        ("locked/op-c", "c1", 15),  # RBAC: cannot tell
    }
    alive = await me.holders_alive(claims)
    assert alive == {("other/op-b", "b1", 30), ("gone/op-d", "d1", 20), ("locked/op-c", "c1", 15)}
    clock.mono += 25.0
    api.put("other", "op-b", {"holderIdentity": "b1", "leaseDurationSeconds": 30})  # renews
    alive = await me.holders_alive(claims)
    assert alive == {("other/op-b", "b1", 30), ("locked/op-c", "c1", 15)}
    clock.mono += 30.0  # b1 stopped renewing
    assert await me.holders_alive(claims) == {("locked/op-c", "c1", 15)}


async def test_a_slow_renewal_is_logged_while_the_lease_holds_and_a_late_one_stops(
    clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A renewal slower than a sixth of the lease is said while the lease still holds (the
    sign before a lost lease); a renewal that comes back past the local deadline is too late:
    the next round stops the leader instead of renewing."""
    api = FakeLeases()
    lease = standby(api, "leader")
    assert await lease.try_acquire()
    delays = iter([3.0, 8.0])  # seconds each renewal takes: slow but in time, then too late
    replace = api.replace_namespaced_lease

    async def slow_replace(name: str, ns: str, body: dict[str, Any]) -> None:
        clock.mono += next(delays, 0.0)
        await replace(name, ns, body)

    async def no_wait(seconds: float) -> None:
        clock.mono += seconds

    monkeypatch.setattr(api, "replace_namespaced_lease", slow_replace)
    monkeypatch.setattr(leader.asyncio, "sleep", no_wait)
    with caplog.at_level("WARNING", logger=leader.log.name):
        await lease.hold()
    assert lease.lost.is_set()
    slow = [r.getMessage() for r in caplog.records if "renewal took" in r.getMessage()]
    assert slow[0].startswith("leader lease renewal took 3.0 s"), slow
    assert any("deadline passed before renewal" in r.getMessage() for r in caplog.records)
