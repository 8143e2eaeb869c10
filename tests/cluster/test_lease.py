"""The leader Lease on the real API server: fencing epochs across acquisitions."""

from __future__ import annotations

import asyncio

import pytest
from refit_operator import cluster
from refit_operator.leader import FENCE_SHIFT, Lease

from testbed.controlplane import ControlPlane

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]


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
            await asyncio.sleep(1.2)  # the old holder stopped renewing: its Lease expires
            new = Lease(api, namespace, "refit-operator", identity, 1)
            assert await new.try_acquire()
            token = new.next_fence()
            assert token > old_token, (identity, hex(token), hex(old_token))
            assert token >> FENCE_SHIFT == new.epoch > old.epoch
            old, old_token = new, new.next_fence()
    finally:
        await api.close()
