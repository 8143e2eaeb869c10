"""The leader Lease on the real API server: fencing epochs across acquisitions, expiry by the
standby's own clock, and renewals that keep their deadline however busy the leader is."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from datetime import UTC, datetime

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes_asyncio import client
from refit_operator.edges import cluster
from refit_operator.edges.leader import FENCE_SHIFT, LeadershipLost, Lease, RenewalThread

from testbed.controlplane import ControlPlane
from testbed.lease_watch import LeaseRenewals, max_renewal_gap

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

DAY = 86_400.0


def control_plane_api(control_plane: ControlPlane) -> k8s.ApiClient:
    """A synchronous client for watching from a thread of the test."""
    return k8s_config.new_client_from_config(str(control_plane.kubeconfig))


async def test_a_new_process_fences_above_its_predecessor_even_under_the_same_identity(
    control_plane: ControlPlane, namespace: str
) -> None:
    """Found on the real node: the chart's operator runs as its container's pid 1, so after a
    container restart the new process could carry its predecessor's identity. A new
    acquisition must start a new epoch anyway: the new process's pass counter starts over,
    and its first token must still be above every token the old one handed out."""
    api = await cluster.connect(str(control_plane.kubeconfig))
    try:
        old = Lease(api, namespace, "refit-operator", "op-1", 1)
        assert await old.try_acquire()
        for _ in range(5):
            old_token = old.next_fence()
        assert await old.try_acquire()  # its renewals keep its epoch
        assert old.next_fence() > old_token
        old_token = old.next_fence()

        for identity in ("op-1", "op-2"):  # the same identity again, then another one
            new = Lease(api, namespace, "refit-operator", identity, 1)
            if identity != old.identity:  # expiry is seen on the new process's own clock
                assert not await new.try_acquire()
                await asyncio.sleep(1.2)  # the old holder stopped renewing: it expires
            assert await new.try_acquire()
            token = new.next_fence()
            assert token > old_token, (identity, hex(token), hex(old_token))
            assert token >> FENCE_SHIFT == new.epoch > old.epoch
            old, old_token = new, new.next_fence()
    finally:
        await api.close()


async def test_a_standby_judges_the_lease_by_its_own_clock(
    control_plane: ControlPlane, namespace: str
) -> None:
    """Issue 24 #10: the holder's renewTime is another machine's wall clock. A live holder a
    day behind must keep its Lease (the standby used to take it at once); a dead holder a
    day ahead must lose it after one lease duration of the standby's own clock (it used to
    hold it for a day)."""
    api = await cluster.connect(str(control_plane.kubeconfig))
    leases = client.CoordinationV1Api(api)
    try:

        async def renew(holder: str, skew: float) -> None:
            doc = await leases.read_namespaced_lease("skewed", namespace)
            doc.spec.renew_time = datetime.fromtimestamp(time.time() + skew, UTC)
            doc.spec.holder_identity = holder
            await leases.replace_namespaced_lease("skewed", namespace, doc)

        body = {"metadata": {"name": "skewed"},
                "spec": {"holderIdentity": "behind", "leaseDurationSeconds": 1}}  # fmt: skip
        await leases.create_namespaced_lease(namespace, body)  # type: ignore[arg-type]  # as is
        me = Lease(api, namespace, "skewed", "standby", 1)
        for _ in range(8):  # 2.4 s of renewals, each a day in the past
            await renew("behind", -DAY)
            assert not await me.try_acquire()
            await asyncio.sleep(0.3)
        await asyncio.sleep(1.2)  # it stopped renewing
        assert await me.try_acquire()

        await renew("ahead", DAY)  # a holder a day ahead that then died
        other = Lease(api, namespace, "skewed", "standby-2", 1)
        assert not await other.try_acquire()
        await asyncio.sleep(1.2)
        assert await other.try_acquire()
    finally:
        await api.close()


def busy(seconds: float) -> int:
    """Work that never awaits, as the operator's pure core does between two awaits: Python
    bytecode and JSON of a large status, holding the interpreter lock but for the
    interpreter's own switches."""
    doc = {"pods": [{"name": f"pod-{i}", "phase": "Loading", "step": i % 11} for i in range(2000)]}
    deadline, rounds = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        rounds += len(json.loads(json.dumps(doc))["pods"])
    return rounds


async def test_renewals_keep_their_deadline_while_the_loop_is_busy(
    control_plane: ControlPlane, namespace: str
) -> None:
    """Issue 29: the renewal used to run on the operator's event loop, so a stretch of work
    without an await longer than two thirds of a lease made the leader stop (the only
    replica exits). On its own thread with its own client, a leader whose loop is busy for
    one and a half lease durations renews on time all along: the API server stores every renewal
    within the deadline, and check() still admits the next call."""
    api = await cluster.connect(str(control_plane.kubeconfig))
    lease = Lease(api, namespace, "busy", "op-busy", 5)  # deadline: 3.33 s after a renewal
    assert await lease.try_acquire()
    seen = LeaseRenewals(control_plane_api(control_plane), namespace, "busy")
    renewals = asyncio.create_task(
        RenewalThread(lease, lambda: cluster.connect(str(control_plane.kubeconfig))).run()
    )
    try:
        await asyncio.sleep(1.0)  # the thread connects and renews once
        started = time.time()
        assert busy(7.5) > 0  # one and a half lease durations without one await
        lease.check()  # still ours: no LeadershipLost
        ended = time.time()
        await asyncio.sleep(0.5)
        gap, count = max_renewal_gap(seen.stop(), started, ended)
        assert not lease.lost.is_set()
        assert count >= 5, count  # one every 0.83 s, give or take the machine
        assert gap < lease.duration * 2 / 3, gap
    finally:
        seen.stop()
        renewals.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewals
        await api.close()
    assert not lease.lost.is_set()  # stopping the thread is not losing the Lease


async def test_a_renewal_thread_that_cannot_renew_loses_the_lease(
    control_plane: ControlPlane, namespace: str
) -> None:
    """Fail closed: a renewal thread that ends on its own (here: it cannot make its client)
    leaves the Lease lost, so the leader stops before its next call."""
    api = await cluster.connect(str(control_plane.kubeconfig))
    lease = Lease(api, namespace, "orphan", "op-orphan", 15)
    assert await lease.try_acquire()

    async def unreachable() -> client.ApiClient:
        raise OSError("no route to the API server")

    try:
        await asyncio.wait_for(RenewalThread(lease, unreachable).run(), 10)
        assert lease.lost.is_set()
        with pytest.raises(LeadershipLost):
            lease.check()
    finally:
        await api.close()
