"""A namespace's pods kept current by a watch (as client-go's informer): the ticks read them
from here instead of LISTing the fleet each time. One LIST at start and at each relist (an
expired resourceVersion, a broken watch); the watch from its resourceVersion after that.

Never a safety check: every write to a pod is conditional on the resourceVersion it was
decided from (cluster.Cluster.claim, withdraw, ClaimedPod.record), so a cache that lags can
only make a write conflict, which each caller handles as it always did. The operator's own
writes and reads of a pod are folded in at once (``put``): the tick after a pass's last write
sees that write, without waiting for the watch to bring it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from ..core.podview import PodView
from . import metrics

log = logging.getLogger(__name__)

WATCH_SECONDS = 300  # the server ends each watch after this long; it is resumed at once
RETRY_SECONDS = 1.0  # after a failed list or watch


def _rv(doc: Mapping[str, Any]) -> int:
    rv = str(doc["metadata"].get("resourceVersion", ""))
    return int(rv) if rv.isdigit() else 0


_TERM = re.compile(r"\s*(?:[^,(]|\([^)]*\))+")


def _holds(term: tuple[str, str, frozenset[str]], labels: Mapping[str, str]) -> bool:
    op, key, values = term
    if op == "exists":
        return key in labels
    if op == "absent":
        return key not in labels
    if op == "in":
        return labels.get(key) in values
    return labels.get(key) not in values  # "notin", and "!=" (one value)


@functools.lru_cache(maxsize=256)
def selector_matcher(selector: str) -> Callable[[Mapping[str, str]], bool]:
    """A kubectl label-selector string (what LabelSelector.canonical writes: ``k=v``,
    ``k!=v``, ``k``, ``!k``, ``k in (a,b)``, ``k notin (a,b)``) as a predicate over labels,
    as the API server applies it to a LIST."""
    terms: list[tuple[str, str, frozenset[str]]] = []
    for m in _TERM.finditer(selector):
        term = m.group(0).strip().lstrip(",").strip()
        if not term:
            continue
        sets = re.fullmatch(r"(\S+)\s+(in|notin)\s+\(([^)]*)\)", term)
        if sets:
            values = frozenset(v.strip() for v in sets[3].split(",") if v.strip())
            terms.append((sets[2], sets[1], values))
        elif "!=" in term:
            key, value = (x.strip() for x in term.split("!=", 1))
            terms.append(("notin", key, frozenset([value])))
        elif "=" in term:
            key, value = (x.strip() for x in term.replace("==", "=").split("=", 1))
            terms.append(("in", key, frozenset([value])))
        elif term.startswith("!"):
            terms.append(("absent", term[1:].strip(), frozenset()))
        else:
            terms.append(("exists", term, frozenset()))
    return lambda labels: all(_holds(t, labels) for t in terms)


class PodWatch:
    """The pods of one namespace: filled by a LIST, kept by a watch (``run``), read by
    ``pods``. ``core`` is kubernetes_asyncio's CoreV1Api (answers as raw JSON)."""

    def __init__(self, core: Callable[[], Any], namespace: str) -> None:
        self._core = core
        self.namespace = namespace
        self._docs: dict[str, dict[str, Any]] = {}
        self._views: dict[str, PodView] = {}  # parsed once per change, not per tick
        self._names: list[str] | None = None  # sorted, as a LIST returns them
        self._rv = ""
        self.synced = asyncio.Event()  # set once the first LIST is in
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self.run(), name=f"pod-watch-{self.namespace}")

    async def pods(self, selector: str) -> list[PodView]:
        """The namespace's pods that ``selector`` selects, by name, as a LIST gives them."""
        self.start()
        await self.synced.wait()
        if self._names is None:
            self._names = sorted(self._docs)
        if not selector:
            return [self._views[n] for n in self._names]
        match = selector_matcher(selector)
        return [v for n in self._names if match((v := self._views[n]).labels)]

    async def named(self, names: Sequence[str]) -> list[PodView]:
        """The pods of these names that exist, as the watch has them now."""
        self.start()
        await self.synced.wait()
        return [self._views[n] for n in names if n in self._views]

    def put(self, doc: dict[str, Any]) -> None:
        """A pod as some answer showed it: kept if it is newer than the one held."""
        name = doc["metadata"]["name"]
        have = self._docs.get(name)
        if have is not None and _rv(have) > _rv(doc):
            return
        if have is None:
            self._names = None
        self._docs[name] = doc
        self._views[name] = PodView.from_pod(doc)

    def _drop(self, doc: Mapping[str, Any]) -> None:
        name = doc["metadata"]["name"]
        have = self._docs.get(name)
        if have is not None and _rv(have) <= _rv(doc):  # not a newer pod of that name
            del self._docs[name]
            del self._views[name]
            self._names = None

    async def _list(self) -> None:
        resp = await self._core().list_namespaced_pod(self.namespace, _preload_content=False)
        body = json.loads(await resp.read())
        if not 200 <= resp.status <= 299:
            raise ApiException(status=resp.status, reason=str(body)[:500])
        listed = body.get("items", [])
        rv = str(body["metadata"].get("resourceVersion", ""))
        at = int(rv) if rv.isdigit() else 0
        names = {d["metadata"]["name"] for d in listed}
        for name in [n for n, d in self._docs.items() if n not in names and _rv(d) <= at]:
            self._drop(self._docs[name])
        for doc in listed:
            self.put(doc)
        self._rv = rv
        self.synced.set()

    async def run(self) -> None:
        """LIST, then watch from its resourceVersion; LIST again when the watch cannot be
        resumed (410 Gone) or fails, resume it when the server ends it."""
        relist = True
        while True:
            try:
                if relist:
                    await self._list()
                    relist = False
                await self._watch()
            except asyncio.CancelledError:
                raise
            except ApiException as e:
                relist = True
                if e.status != 410:
                    metrics.api_retry("watch")
                    log.warning("pods of %s: watch failed, listing again: %s", self.namespace, e)
                    await asyncio.sleep(RETRY_SECONDS)
            except Exception as e:  # a dropped connection, a malformed answer
                relist = True
                metrics.api_retry("watch")
                log.warning("pods of %s: watch failed, listing again: %s", self.namespace, e)
                await asyncio.sleep(RETRY_SECONDS)

    async def _watch(self) -> None:
        resp = await self._core().list_namespaced_pod(
            self.namespace, watch=True, resource_version=self._rv,
            allow_watch_bookmarks=True, timeout_seconds=WATCH_SECONDS,
            _request_timeout=WATCH_SECONDS + 30, _preload_content=False,
        )  # fmt: skip
        try:
            if not 200 <= resp.status <= 299:
                raise ApiException(status=resp.status, reason=(await resp.read()).decode()[:500])
            while line := await resp.content.readline():
                event = json.loads(line)
                kind, doc = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ApiException(status=doc.get("code", 500), reason=doc.get("message"))
                if kind in ("ADDED", "MODIFIED"):
                    self.put(doc)
                elif kind == "DELETED":
                    self._drop(doc)
                rv = str((doc.get("metadata") or {}).get("resourceVersion", ""))
                if rv:
                    self._rv = rv
        finally:
            resp.release()
