"""What the engine keeps per refit (RefitState, dropped with the refit) and what one tick
read (Tick), handed to each of the tick's steps. Nothing here is needed to resume after a
restart: caches are read again and passes resume from the pods' progress records.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from refit_worker.contract import ProbeReference

from ..core import checksums
from ..core.pod_state import RefitView
from ..core.podflow import Progress
from ..core.podview import PodView
from ..core.preflight_cache import Identity
from ..core.status import peer_nlls
from .pass_context import BroadcastSource


@dataclass
class Secrets:
    """The pods' credentials, read from the Secrets the spec names: by the preflight, or by
    the first tick that starts a pass after a restart (the preflight is not rerun)."""

    token: str | None = None  # the pods' admin token
    api_key: str | None = None  # vLLM's --api-key, for /v1
    loaded: bool = False


@dataclass
class Passes:
    """The pod passes this process runs for the refit (pod_pass.run_pass), by pod name. The
    pods' progress records what a pass did; a restarted process resumes from those."""

    tasks: dict[str, asyncio.Task[Any]] = field(default_factory=dict)
    # The pod object (uid, address) each pass in flight drives: a pass belongs to that pod.
    driven: dict[str, PodView] = field(default_factory=dict)
    staged_ahead: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # pod -> stage
    admitted: Mapping[str, Identity] = field(default_factory=dict)  # see PassContext
    lora: set[str] = field(default_factory=set)  # see PassContext
    drafters: dict[str, str] = field(default_factory=dict)  # see PassContext
    live: dict[str, Progress] = field(default_factory=dict)  # progress of passes (pod_pass)

    def running(self) -> list[asyncio.Task[Any]]:
        """Every task this process runs for the refit: what its deletion cancels."""
        return [*self.tasks.values(), *self.staged_ahead.values()]


@dataclass
class Listing:
    """This tick's pods, as listed: what the tick's decisions and the passes it starts act
    on. Built anew by each tick."""

    pods: list[PodView] = field(default_factory=list)
    by_name: dict[str, PodView] = field(default_factory=dict)
    # NLLs of the pods passed at a version, sorted: every probe of the tick compares against
    # the same list, built once (per probe it was quadratic in pods).
    peers: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def of(cls, pods: list[PodView]) -> Listing:
        return cls(pods, {p.name: p for p in pods})


@dataclass
class Reported:
    """What this process already wrote, published or logged for the refit, so that it does
    so once: a restarted process does it once more, which is harmless."""

    written: dict[str, Any] | None = None  # the last status written
    written_at: float = float("-inf")  # when (times.monotonic()); progress waits on it
    thresholds_published: bool = False
    sequence_ignored: bool = False  # a changed spec.sequence was logged


@dataclass
class RefitState:
    """In-memory state of one refit, dropped with it (Engine._forget): nothing here is needed
    to resume after a restart. Caches (references, broadcast) are read again, secrets too,
    passes resume from the pods' progress records, and a status is written again only if the
    decision differs from the one stored."""

    passes: Passes = field(default_factory=Passes)
    secrets: Secrets = field(default_factory=Secrets)
    listing: Listing = field(default_factory=Listing)
    reported: Reported = field(default_factory=Reported)
    references: dict[str, ProbeReference] = field(default_factory=dict)  # by checkpoint path
    broadcast: BroadcastSource | None = None  # spec.broadcast, once its manifest was read
    # The pods' read-backs: reset from each tick's listing, put by the passes as they go.
    readbacks: checksums.Readbacks = field(default_factory=checksums.Readbacks)
    waiting: bool = False  # another refit shares its pods and is not finished, or holds one
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # decide again now
    # The newest document of the refit seen (a GET, a watch event, the answer to our own
    # status write): what a hand-off's tick decides from instead of reading it again. Its
    # status write is conditional on its resourceVersion, so a stale one is only a conflict.
    doc: dict[str, Any] | None = None

    def saw(self, doc: dict[str, Any]) -> None:
        """Keep ``doc`` if it is newer than the one kept (resourceVersions are etcd's
        revision: a watch event that arrives after our own write's answer is older)."""
        if self.doc is None or revision(doc) >= revision(self.doc):
            self.doc = doc

    def peer_nlls(self, version: str) -> list[float]:
        peers = self.listing.peers
        if version not in peers:
            peers[version] = sorted(peer_nlls(self.listing.pods, version))
        return peers[version]


def revision(doc: dict[str, Any]) -> int:
    """An object's resourceVersion as a number (0 when it is not one)."""
    rv = str(doc["metadata"].get("resourceVersion", ""))
    return int(rv) if rv.isdigit() else 0


@dataclass(frozen=True)
class Tick:
    """What one tick read, built once and handed to each of its steps (as Argo Rollouts'
    rolloutContext): the refit as read and its view, and what is kept for it."""

    doc: dict[str, Any]  # the WeightRefit as read; its status is written against this read
    view: RefitView
    state: RefitState
    # The Secrets' and ConfigMaps' data this tick read, by (kind, namespace, name): each is
    # read once (controller/inputs.py). None: absent.
    reads: dict[tuple[str, str, str], dict[str, str] | None] = field(default_factory=dict)

    @property
    def namespace(self) -> str:
        return self.view.namespace
