"""The leader Lease on the real API server: fencing epochs across acquisitions."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import pytest
from kubernetes_asyncio import client
from refit_operator import cluster
from refit_operator.leader import FENCE_SHIFT, Lease

from testbed.controlplane import ControlPlane

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

DAY = 86_400.0


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
        await leases.create_namespaced_lease(namespace, body)
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
