"""Leader election on a coordination.k8s.io Lease: exactly one operator replica acts.

A replica acquires the Lease when it is absent, already its own, or expired (renewTime +
leaseDurationSeconds in the past). Updates carry the resourceVersion, so two replicas racing
for an expired Lease cannot both win. The leader renews every sixth of the duration and stops
acting (the process exits) the moment it cannot renew in time.

Renewal alone does not stop a leader that was frozen (SIGSTOP, a long GC pause, CPU
throttling): when it wakes, its passes carry on before the renewal loop runs again. So the
leader also keeps a local monotonic deadline, two thirds of a lease duration after the last
renewal it sent, and ``check()`` (called before every API write and every worker call) raises
:class:`LeadershipLost` once it has passed. Each acquisition also fixes the fencing epoch (the
Lease's ``leaseTransitions``, counted up on every acquisition, even by the same identity): the
fencing tokens of a newer leader are always higher.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from . import times
from .cluster import read_json

log = logging.getLogger(__name__)

FENCE_SHIFT = 32  # token = epoch << 32 | pass sequence: a newer leader's tokens are higher


class LeadershipLost(RuntimeError):
    """This replica may no longer be the leader: it must not make another call."""


class Lease:
    def __init__(
        self, api_client: client.ApiClient, namespace: str, name: str, identity: str, duration: int
    ) -> None:
        self.api: Any = client.CoordinationV1Api(api_client)
        self.namespace, self.name, self.identity, self.duration = (
            namespace,
            name,
            identity,
            duration,
        )
        self.epoch = 0  # leaseTransitions when this replica acquired the Lease
        self.holding = False  # acquired by this object (its renewals keep the epoch)
        self.valid_until = 0.0  # monotonic: acting is safe before this moment
        self._passes = 0
        self.lost = asyncio.Event()

    def check(self) -> None:
        """Raise unless the lease is certainly still ours (see the module docstring)."""
        if self.lost.is_set() or time.monotonic() >= self.valid_until:
            self.lost.set()
            raise LeadershipLost(
                f"{self.identity}: the leader lease may have expired; stopping before acting"
            )

    def next_fence(self) -> int:
        """A fencing token for a new pod pass: higher than any earlier pass of any leader."""
        self._passes += 1
        return (self.epoch << FENCE_SHIFT) | self._passes

    def _body(self, old: dict[str, Any] | None, now: float) -> dict[str, Any]:
        spec = dict((old or {}).get("spec") or {})
        # A new holder, or this identity again in a new process (a restarted container's
        # operator is pid 1 again), starts a new epoch: its pass counter starts over, and
        # its fencing tokens must still be higher than its predecessor's.
        if not self.holding or spec.get("holderIdentity") != self.identity:
            spec["acquireTime"] = times.rfc3339_micro(now)
            spec["leaseTransitions"] = int(spec.get("leaseTransitions", 0)) + (1 if old else 0)
        spec.update(
            holderIdentity=self.identity,
            leaseDurationSeconds=self.duration,
            renewTime=times.rfc3339_micro(now),
        )
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if old:
            meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": spec,
        }

    async def try_acquire(self) -> bool:
        sent = time.monotonic()  # the deadline counts from before the request left
        now = time.time()
        try:
            resp = await self.api.read_namespaced_lease(
                self.name, self.namespace, _preload_content=False
            )
            old = await read_json(resp)
        except ApiException as e:
            if e.status != 404:
                raise
            old = None
        try:
            if old is None:
                body = self._body(None, now)
                await self.api.create_namespaced_lease(self.namespace, body)
                self._held(body, sent)
                return True
            spec = old.get("spec") or {}
            holder, renewed = spec.get("holderIdentity"), spec.get("renewTime")
            duration = int(spec.get("leaseDurationSeconds") or self.duration)
            renewed_at = times.epoch(renewed)
            expired = renewed_at is None or now - renewed_at > duration
            if holder not in (None, "", self.identity) and not expired:
                return False
            body = self._body(old, now)
            await self.api.replace_namespaced_lease(self.name, self.namespace, body)
            self._held(body, sent)
            return True
        except ApiException as e:
            if e.status == 409:  # someone else won the race
                return False
            raise

    def _held(self, body: dict[str, Any], sent: float) -> None:
        self.epoch = int(body["spec"].get("leaseTransitions", 0))
        self.holding = True
        self.valid_until = sent + self.duration * 2 / 3

    async def acquire(self) -> None:
        while True:
            try:
                if await self.try_acquire():
                    log.info(
                        "leader lease %s/%s acquired by %s",
                        self.namespace,
                        self.name,
                        self.identity,
                    )
                    return
            except ApiException as e:
                log.warning("leader lease: %s", e.reason)
            await asyncio.sleep(max(self.duration / 3, 0.5))

    async def hold(self) -> None:
        """Renew until renewal fails past the local deadline (or another replica holds the
        Lease, or ``check()`` found the deadline passed); then set ``lost`` and return."""
        while not self.lost.is_set():
            # Renewing often leaves slack between a renewal and the deadline: a busy event
            # loop that renews late must not trip check() (a sixth: 1.5 s of slack at 3 s).
            await asyncio.sleep(max(self.duration / 6, 0.25))
            if time.monotonic() >= self.valid_until:
                # Frozen past the deadline: another replica may lead now. Renewing would
                # hide that; stop instead.
                log.error("leader lease deadline passed before renewal (process paused?)")
                self.lost.set()
                break
            try:
                if await self.try_acquire():
                    continue
                log.error("leader lease taken by another replica")
                self.lost.set()
            except Exception as e:
                log.warning("leader lease renewal failed: %s", e)
                if time.monotonic() >= self.valid_until:
                    self.lost.set()
