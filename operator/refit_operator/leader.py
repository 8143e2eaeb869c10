"""Leader election on a coordination.k8s.io Lease: exactly one operator replica acts.

A replica acquires the Lease when it is absent, already its own, or expired (renewTime +
leaseDurationSeconds in the past). Updates carry the resourceVersion, so two replicas racing
for an expired Lease cannot both win. The leader renews every third of the duration and stops
acting (the process exits) the moment it cannot renew in time.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from .cluster import read_json

log = logging.getLogger(__name__)


def _micro(ts: datetime) -> str:
    return ts.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(text: str) -> datetime:
    return datetime.strptime(text.replace("Z", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z")


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

    def _body(self, old: dict[str, Any] | None, now: datetime) -> dict[str, Any]:
        spec = dict((old or {}).get("spec") or {})
        if spec.get("holderIdentity") != self.identity:
            spec["acquireTime"] = _micro(now)
            spec["leaseTransitions"] = int(spec.get("leaseTransitions", 0)) + (1 if old else 0)
        spec.update(
            holderIdentity=self.identity, leaseDurationSeconds=self.duration, renewTime=_micro(now)
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
        now = datetime.now(UTC)
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
                await self.api.create_namespaced_lease(self.namespace, self._body(None, now))
                return True
            spec = old.get("spec") or {}
            holder, renewed = spec.get("holderIdentity"), spec.get("renewTime")
            duration = int(spec.get("leaseDurationSeconds") or self.duration)
            expired = renewed is None or (now - _parse(renewed)).total_seconds() > duration
            if holder not in (None, "", self.identity) and not expired:
                return False
            await self.api.replace_namespaced_lease(self.name, self.namespace, self._body(old, now))
            return True
        except ApiException as e:
            if e.status == 409:  # someone else won the race
                return False
            raise

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

    async def hold(self, lost: asyncio.Event) -> None:
        """Renew until renewal fails for longer than the lease lasts; then set ``lost``."""
        last_ok = asyncio.get_running_loop().time()
        while not lost.is_set():
            await asyncio.sleep(max(self.duration / 3, 0.5))
            try:
                if await self.try_acquire():
                    last_ok = asyncio.get_running_loop().time()
                    continue
                log.error("leader lease taken by another replica")
                lost.set()
            except Exception as e:
                log.warning("leader lease renewal failed: %s", e)
                # Stop before the lease can expire and another replica starts acting.
                if asyncio.get_running_loop().time() - last_ok > self.duration * 2 / 3:
                    lost.set()
