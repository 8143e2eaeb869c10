"""Leader election on a coordination.k8s.io Lease: exactly one operator replica acts.

A replica acquires the Lease when it is absent, already its own, released, or expired.
Expired is judged as client-go does, never from the holder's ``renewTime`` (another machine's
wall clock, which may be minutes off): the Lease is expired once this process has seen its
record (its resourceVersion) unchanged for ``leaseDurationSeconds`` of its own monotonic
clock (:class:`Observer`). Updates carry the resourceVersion, so two replicas racing for an
expired Lease cannot both win. The leader renews every sixth of the duration and stops
acting (the process exits) the moment it cannot renew in time.

The renewals run on a thread of their own (:class:`RenewalThread`), with their own event loop
and API client: the operator's own work (planning, status of a 10,000-pod fleet, decoding
large lists) runs between awaits on the main loop and could delay a renewal there for as long
as its longest stretch without an await, which grows with the fleet. A thread is preempted
by the interpreter every few milliseconds, so a renewal waits at most for one call that
holds the interpreter lock without releasing it (one JSON decode of a list), not for the
operator's work. The state the two threads share is a few fields written by the renewal
thread and read by the main loop (``valid_until``, ``epoch``; ``lost`` is a threading.Event)
and the :class:`Observer`, which takes a lock.

Renewal alone does not stop a leader that was frozen (SIGSTOP, a long GC pause, CPU
throttling): when it wakes, its passes carry on before the renewal loop runs again. So the
leader also keeps a local monotonic deadline, two thirds of a lease duration after the last
renewal it sent, and ``check()`` (called before every API write and every worker call) raises
:class:`LeadershipLost` once it has passed.

Fencing tokens come from the pods' own resourceVersions (claim.claim_fence), which hold
across Leases and installations. Only where the API server's resourceVersions are not
integers does a pass take ``next_fence()``: the Lease's ``leaseTransitions`` (counted up on
every acquisition, even by the same identity) as the epoch, then the pass sequence.

A pod claimed by another operator process is taken over only once that process provably
cannot act any more (:meth:`Lease.holders_alive`): the Lease its claim names is held by
another identity or released, or this process has seen that Lease unchanged (or absent) for
a lease duration of its own clock.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from ..core import times
from .cluster import read_json

log = logging.getLogger(__name__)

FENCE_SHIFT = 32  # token = epoch << 32 | pass sequence: a newer leader's tokens are higher
# The chart's lease (its Deployment passes no --lease-seconds): a standby takes over at most
# this long after the leader stopped renewing.
DEFAULT_LEASE_SECONDS = 15
SWITCH_INTERVAL = 0.001  # seconds: the interpreter's switch interval while renewals run


class LeadershipLost(RuntimeError):
    """This replica may no longer be the leader: it must not make another call."""


class Observer:
    """When this process saw each Lease's record change, on its own monotonic clock
    (client-go's observedTime): the only clock a judgement of expiry may use. Bounded by the
    Leases looked at within the last ``FORGET_SECONDS``."""

    FORGET_SECONDS = 600.0

    def __init__(self) -> None:
        # (namespace, name) -> (resourceVersion or None when absent, seen since, looked at)
        self._seen: dict[tuple[str, str], tuple[str | None, float, float]] = {}
        # The renewal thread (its own Lease) and the main loop (other Leases' holders) both
        # record what they read.
        self._lock = threading.Lock()

    def unchanged_for(self, key: tuple[str, str], version: str | None, now: float) -> float:
        """Seconds (of ``now``'s monotonic clock) since this process first saw the Lease at
        ``version``; 0 when it has just changed or is seen for the first time."""
        with self._lock:
            self._seen = {
                k: v for k, v in self._seen.items() if now - v[2] < self.FORGET_SECONDS or k == key
            }
            old = self._seen.get(key)
            since = old[1] if old is not None and old[0] == version else now
            self._seen[key] = (version, since, now)
            return now - since


def holder_alive(
    spec: Mapping[str, Any] | None, holder: str, unchanged_for: float, duration: float
) -> bool:
    """Whether ``holder`` may still act under a Lease whose record (``spec``; None: there is
    no such Lease) this process has seen unchanged for ``unchanged_for`` seconds.

    Held by another identity, or released: no (whoever took it waited out the lease, past
    the old holder's own deadline). Held by ``holder``: until it has gone a lease duration
    without a renewal this process saw. Absent: a holder that still acts re-creates it
    within a sixth of ``duration`` (its renewal), so it may act until the absence has lasted
    ``duration``."""
    if spec is not None:
        if spec.get("holderIdentity") != holder:
            return False
        duration = float(spec.get("leaseDurationSeconds") or duration)
    return unchanged_for < duration


class Lease:
    def __init__(
        self,
        api_client: client.ApiClient | None,
        namespace: str,
        name: str,
        identity: str,
        duration: int,
        *,
        api: Any = None,
    ) -> None:
        """``api``: what serves the Leases (``read_namespaced_lease``, ``create_namespaced_lease``,
        ``replace_namespaced_lease``, as kubernetes_asyncio's CoordinationV1Api answers them);
        default: CoordinationV1Api over ``api_client`` (the explorer hands in its in-memory
        API server's)."""
        self.api: Any = api if api is not None else client.CoordinationV1Api(api_client)
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
        # monotonic: when this process created the Lease (absent: deleted, or never made).
        # A holder that led before the deletion may act until its own deadline, which it
        # counts from a renewal before the deletion: its claims stay its own for a lease
        # duration from here (holders_alive), as a takeover of a held Lease waits it out.
        self.created_at: float | None = None
        # Set by the renewal thread, read before every call on the main loop.
        self.lost = threading.Event()
        self.observer = Observer()

    @property
    def key(self) -> str:
        """How a claim names this Lease: ``namespace/name``."""
        return f"{self.namespace}/{self.name}"

    def check(self) -> None:
        """Raise unless the lease is certainly still ours (see the module docstring)."""
        if self.lost.is_set() or times.monotonic() >= self.valid_until:
            self.lost.set()
            raise LeadershipLost(
                f"{self.identity}: the leader lease may have expired; stopping before acting"
            )

    def next_fence(self) -> int:
        """The fallback fencing token (claim.claim_fence): higher than any earlier pass of
        any leader of this Lease, while the Lease is not re-created."""
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

    async def _read(self, namespace: str, name: str, api: Any = None) -> dict[str, Any] | None:
        try:
            resp = await (api or self.api).read_namespaced_lease(
                name, namespace, _preload_content=False
            )
            doc: dict[str, Any] = await read_json(resp)
        except ApiException as e:
            if e.status != 404:
                raise
            return None
        return doc

    async def try_acquire(self, api: Any = None) -> bool:
        """One acquisition or renewal; ``api``: what to send it with (default ``self.api``;
        the renewal thread's own, whose client belongs to that thread's loop)."""
        api = api or self.api
        sent = times.monotonic()  # the deadline counts from before the request left
        old = await self._read(self.namespace, self.name, api)
        version = old["metadata"].get("resourceVersion") if old else None
        unchanged = self.observer.unchanged_for(
            (self.namespace, self.name), version, times.monotonic()
        )
        now = times.now()  # renewTime: for people; no replica judges the Lease by it
        try:
            if old is None:
                body = self._body(None, now)
                await api.create_namespaced_lease(self.namespace, body)
                self._held(body, sent)
                self.created_at = sent
                return True
            spec = old.get("spec") or {}
            holder = spec.get("holderIdentity")
            if holder not in (None, "", self.identity) and holder_alive(
                spec, str(holder), unchanged, self.duration
            ):
                return False
            body = self._body(old, now)
            await api.replace_namespaced_lease(self.name, self.namespace, body)
            self._held(body, sent)
            return True
        except ApiException as e:
            if e.status == 409:  # someone else won the race
                return False
            raise

    async def holders_alive(
        self, holders: Collection[tuple[str, str, int]]
    ) -> set[tuple[str, str, int]]:
        """Which of these (Lease ``namespace/name``, holder identity, lease seconds), each
        taken from a pod's claim, may still act (:func:`holder_alive`); one read per Lease.
        A Lease this process may not read (RBAC) or cannot read now leaves its holders
        alive: nothing proves they stopped."""
        alive: set[tuple[str, str, int]] = set()
        if self.created_at is not None:  # see __init__: this Lease was absent, then ours
            held_for = times.monotonic() - self.created_at
            alive |= {
                h for h in holders
                if h[0] == self.key and h[1] != self.identity and held_for < (h[2] or self.duration)
            }  # fmt: skip
        for lease in {h[0] for h in holders}:
            namespace, _, name = lease.partition("/")
            try:
                doc = await self._read(namespace, name)
            except Exception as e:  # RBAC (403), or the API server unreachable now
                log.warning(
                    "Lease %s of another operator's claim unreadable (%s): its pods wait for "
                    "that operator (grant get on that Lease to let this one judge it)", lease, e,
                )  # fmt: skip
                alive |= {h for h in holders if h[0] == lease}
                continue
            version = doc["metadata"].get("resourceVersion") if doc else None
            unchanged = self.observer.unchanged_for((namespace, name), version, times.monotonic())
            spec = (doc.get("spec") or {}) if doc else None
            alive |= {
                h for h in holders
                if h[0] == lease and holder_alive(spec, h[1], unchanged, h[2] or self.duration)
            }  # fmt: skip
        return alive

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

    async def hold(self, api: Any = None) -> None:
        """Renew until renewal fails past the local deadline (or another replica holds the
        Lease, or ``check()`` found the deadline passed); then set ``lost`` and return.
        ``api``: as for :meth:`try_acquire` (the operator runs this on
        :class:`RenewalThread`)."""
        while not self.lost.is_set():
            # Renewing often leaves slack between a renewal and the deadline: a renewal that
            # is late (a slow API server, a loaded machine) must not trip check() (a sixth:
            # 2.5 s of slack at the chart's 15 s).
            await asyncio.sleep(max(self.duration / 6, 0.25))
            if times.monotonic() >= self.valid_until:
                # Frozen past the deadline: another replica may lead now. Renewing would
                # hide that; stop instead.
                log.error("leader lease deadline passed before renewal (process paused?)")
                self.lost.set()
                break
            try:
                sent = times.monotonic()
                renewed = await self.try_acquire(api)
                took = times.monotonic() - sent
                if took > self.duration / 6:
                    # Slow renewals come before a lost lease: say so while it still holds.
                    log.warning(
                        "leader lease renewal took %.1f s (the lease is %d s; a leader that "
                        "cannot renew within %.1f s stops)",
                        took, self.duration, self.duration * 2 / 3,
                    )  # fmt: skip
                if renewed:
                    continue
                log.error("leader lease taken by another replica")
                self.lost.set()
            except Exception as e:
                log.warning("leader lease renewal failed: %s", e)
                if times.monotonic() >= self.valid_until:
                    self.lost.set()


class RenewalThread:
    """:meth:`Lease.hold` on a thread of its own, with its own event loop and its own API
    client (``connect`` makes it, in that loop): nothing the operator does on its main loop
    delays a renewal (see the module docstring). Should the thread end for any reason other
    than :meth:`run` being cancelled (a client that cannot be made, an error), the Lease is
    marked lost: without renewals the leader must not act."""

    def __init__(self, lease: Lease, connect: Callable[[], Awaitable[client.ApiClient]]) -> None:
        self.lease, self._connect = lease, connect
        self._guard = threading.Lock()  # _stopping and _task/_loop, set from both threads
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Renew on the thread until the Lease is lost, then return; cancelled (the operator
        stops): stop the thread first."""
        # A thread that wants the interpreter lock waits up to the switch interval for each
        # handover while the main loop computes; a renewal (an HTTP round trip) takes dozens.
        # Measured behind a loop busy with JSON (tests/cluster/test_lease.py, 1 s lease): at
        # 5 ms (the default) a renewal missed the 0.67 s deadline; at 1 ms the longest gap
        # was 0.4-0.5 s. Forced handovers happen only while the renewal thread wants the
        # lock, a few milliseconds per renewal.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
        main = asyncio.get_running_loop()
        ended: asyncio.Future[None] = main.create_future()

        def finished() -> None:
            if not ended.done():
                ended.set_result(None)

        thread = threading.Thread(
            target=self._main, args=(lambda: main.call_soon_threadsafe(finished),),
            name="lease-renewal", daemon=True,
        )  # fmt: skip
        thread.start()
        try:
            await ended
        finally:
            self._stop()
            # Closing the thread's client takes a moment; the join is bounded and runs off
            # the loop so a cancelled operator still shuts its other work down meanwhile.
            await asyncio.shield(asyncio.to_thread(thread.join, 10.0))

    def _stop(self) -> None:
        with self._guard:
            self._stopping = True
            if self._loop is not None and self._task is not None:
                self._loop.call_soon_threadsafe(self._task.cancel)

    def _main(self, done: Callable[[], None]) -> None:
        try:
            asyncio.run(self._hold())
        except BaseException as e:  # the thread must not die silently: the Lease lapses
            if not isinstance(e, asyncio.CancelledError):
                log.error("leader lease renewal thread failed: %r", e)
        finally:
            with self._guard:
                if not self._stopping:
                    self.lease.lost.set()
            done()

    async def _hold(self) -> None:
        with self._guard:
            if self._stopping:
                return
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        try:
            api_client = await self._connect()
            try:
                await self.lease.hold(client.CoordinationV1Api(api_client))
            finally:
                await api_client.close()
        finally:
            with self._guard:  # nothing to cancel any more: the loop is about to close
                self._loop = self._task = None
