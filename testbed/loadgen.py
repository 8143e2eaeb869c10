"""A load generator for refits under live traffic: rollout-worker-like clients that keep
sending completions to a fleet's pods while the operator refits them, and record what became
of every request.

    router = GateRouter(fleet.pods, port)        # which pods are in traffic, as a gateway sees it
    with LoadGenerator(router.targets, streams=4, deadline_s=120) as load:
        ...                                      # refit the fleet
    load.records                                 # one Record per attempt

Requests go to vLLM's token-in-token-out endpoint, ``POST /inference/v1/generate`` (servers
started with ``--enable-scale-out``): it is what an RL rollout worker speaks (token ids in and
out), and its final output carries ``weight_versions``, the spans of output tokens each weight
version produced (vLLM 0.32 tracks them per request; ``/v1/completions`` does not return them).
A request that a ``keep`` drain froze across a refit therefore names both versions.

Each attempt's outcome is one of OUTCOMES; a stream that ends without a final chunk (finish
reason and ``[DONE]``) is ``truncated``, never taken for a complete answer. vLLM's clean abort
is a complete answer whose finish reason is ``abort``. With ``retries`` the client retries what
it can (aborted, refused, no pod in traffic, connection errors) as a rollout worker would, and
every logical request ends ``ok`` or with an error the client saw: ``lost`` lists any that did
neither.

Bounded in count (``max_requests``) and time (``deadline_s``); loopback targets only (a
target elsewhere is refused when it is named). No pytest in here: the tests, the bench and the
real node's checks share it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from refit_worker.contract import CLIENT_KEEPALIVE_SECONDS, READINESS_GATE

GENERATE_PATH = "/inference/v1/generate"
# ok: complete on the pod's weights; aborted: vLLM's clean abort (finish reason "abort");
# refused: an HTTP error answer; truncated: a body that ended before its final chunk;
# connection: no answer (refused, reset); timeout: no answer in time; no_target: no pod in
# traffic to send to.
OUTCOMES = ("ok", "aborted", "refused", "truncated", "connection", "timeout", "no_target")
RETRYABLE = frozenset({"aborted", "refused", "connection", "no_target", "truncated"})


class NotLoopback(ValueError):
    """A target outside 127.0.0.0/8: the load generator sends nothing off the machine."""


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    try:
        loopback = ipaddress.ip_address(host) in ipaddress.ip_network("127.0.0.0/8")
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise NotLoopback(
            f"the load generator sends only to loopback addresses (127.0.0.0/8); "
            f"refused target {url!r}"
        )


@dataclass(frozen=True)
class Target:
    """One pod as a client reaches it."""

    pod: str
    base_url: str

    def __post_init__(self) -> None:
        check_loopback(self.base_url)


@dataclass(frozen=True)
class Span:
    """Output tokens [start, end) produced by one weight version."""

    version: str
    start: int
    end: int


@dataclass
class Record:
    """One attempt of one logical request."""

    request: int  # the logical request (attempts of one request share it)
    attempt: int  # 0 for the first try
    pod: str  # "" when no pod was in traffic
    start: float  # epoch seconds the request was sent
    end: float = 0.0
    outcome: str = ""
    status: int | None = None
    detail: str = ""  # error body or exception, truncated
    finish_reason: str | None = None
    tokens: int = 0
    spans: tuple[Span, ...] = ()

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def versions(self) -> tuple[str, ...]:
        """The weight versions that produced this request's tokens, in order."""
        return tuple(s.version for s in self.spans)

    def to_json(self) -> dict[str, Any]:
        return {
            "request": self.request, "attempt": self.attempt, "pod": self.pod,
            "start": self.start, "end": self.end, "outcome": self.outcome,
            "status": self.status, "detail": self.detail, "finishReason": self.finish_reason,
            "tokens": self.tokens, "versions": [[s.version, s.start, s.end] for s in self.spans],
        }  # fmt: skip


def parse_spans(choice: dict[str, Any]) -> tuple[Span, ...]:
    raw = choice.get("weight_versions") or []
    return tuple(Span(str(s["version"]), int(s["start"]), int(s["end"])) for s in raw)


def classify_final(record: Record, choice: dict[str, Any], tokens: int) -> None:
    """Fill ``record`` from the final choice of a complete answer."""
    record.finish_reason = choice.get("finish_reason")
    record.tokens = tokens
    record.spans = parse_spans(choice)
    record.outcome = "aborted" if record.finish_reason == "abort" else "ok"


class LoadGenerator:
    """``streams`` concurrent clients, each sending one request at a time to a pod that
    ``route()`` says is in traffic (round robin), until ``max_requests`` were sent,
    ``deadline_s`` passed or ``stop()``. Runs its own event loop in a thread, so synchronous
    tests drive refits meanwhile."""

    def __init__(
        self,
        route: Callable[[], Sequence[Target]],
        *,
        streams: int = 4,
        max_requests: int = 10_000,
        deadline_s: float = 300.0,
        max_tokens: int = 200,
        prompt: Sequence[int] = (5, 6, 7, 8),
        stream: bool = False,
        timeout_s: float = 60.0,
        retries: int = 0,
        retry_backoff_s: float = 0.2,
        api_key: str | None = None,
        pause_s: float = 0.0,
    ) -> None:
        if streams < 1 or max_requests < 1 or deadline_s <= 0:
            raise ValueError("streams and max_requests must be at least 1, deadline_s above 0")
        self.route = route
        self.streams, self.max_requests, self.deadline_s = streams, max_requests, deadline_s
        self.max_tokens, self.prompt, self.stream = max_tokens, list(prompt), stream
        self.timeout_s, self.retries, self.retry_backoff_s = timeout_s, retries, retry_backoff_s
        self.pause_s = pause_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.records: list[Record] = []
        self._sent = 0
        self._next_request = 0
        self._rr = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ----------------------------------------------------------------- control
    def start(self) -> LoadGenerator:
        self._thread = threading.Thread(target=self._main, name="loadgen", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> list[Record]:
        """Stop sending; wait for the requests in flight to end; the records."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout if timeout is not None else self.timeout_s + 10)
            if self._thread.is_alive():
                raise TimeoutError("load generator did not stop")
        if self._error is not None:
            raise RuntimeError(f"load generator failed: {self._error!r}") from self._error
        return self.records

    def __enter__(self) -> LoadGenerator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -------------------------------------------------------------------- loop
    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as e:  # surfaced by stop()
            self._error = e

    async def _run(self) -> None:
        deadline = time.monotonic() + self.deadline_s
        # Idle connections expire before vLLM closes them: reusing one at the moment the
        # server closes it failed a request with ReadError('') and no answer (CI, twice).
        limits = httpx.Limits(
            max_connections=self.streams * 4, keepalive_expiry=CLIENT_KEEPALIVE_SECONDS
        )
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:
            await asyncio.gather(*(self._client(client, deadline) for _ in range(self.streams)))

    def _more(self, deadline: float) -> bool:
        return (
            not self._stop.is_set()
            and time.monotonic() < deadline
            and self._sent < self.max_requests
        )

    async def _client(self, client: httpx.AsyncClient, deadline: float) -> None:
        while self._more(deadline):
            request = self._next_request
            self._next_request += 1
            for attempt in range(self.retries + 1):
                record = await self._attempt(client, request, attempt)
                if record.outcome not in RETRYABLE or attempt == self.retries:
                    break
                if not self._more(deadline):
                    break
                await asyncio.sleep(self.retry_backoff_s * (2**attempt))
            if self.pause_s:
                await asyncio.sleep(self.pause_s)

    def _pick(self) -> Target | None:
        targets = list(self.route())
        if not targets:
            return None
        self._rr += 1
        return targets[self._rr % len(targets)]

    async def _attempt(self, client: httpx.AsyncClient, request: int, attempt: int) -> Record:
        target = self._pick()
        record = Record(request, attempt, target.pod if target else "", time.time())
        self.records.append(record)
        if target is None:
            record.outcome, record.end = "no_target", time.time()
            await asyncio.sleep(0.05)
            return record
        self._sent += 1
        body = {
            "token_ids": self.prompt,
            "sampling_params": {"max_tokens": self.max_tokens, "temperature": 0,
                                "ignore_eos": True},
            "stream": self.stream,
        }  # fmt: skip
        url = target.base_url + GENERATE_PATH
        try:
            if self.stream:
                await self._streamed(client, url, body, record)
            else:
                response = await client.post(url, json=body, headers=self.headers)
                self._answered(response.status_code, response.text, record)
        except httpx.TimeoutException as e:
            record.outcome, record.detail = "timeout", repr(e)[:300]
        except httpx.RemoteProtocolError as e:  # the body ended early: never a complete answer
            record.outcome, record.detail = "truncated", repr(e)[:300]
        except httpx.TransportError as e:
            record.outcome, record.detail = "connection", repr(e)[:300]
        record.end = time.time()
        return record

    @staticmethod
    def _answered(status: int, text: str, record: Record) -> None:
        record.status = status
        if status != 200:
            record.outcome, record.detail = "refused", text[:300]
            return
        try:
            choice = json.loads(text)["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            record.outcome, record.detail = "truncated", text[-300:]
            return
        classify_final(record, choice, len(choice.get("token_ids") or []))

    async def _streamed(
        self, client: httpx.AsyncClient, url: str, body: dict[str, Any], record: Record
    ) -> None:
        tokens, final, done = 0, None, False
        async with client.stream("POST", url, json=body, headers=self.headers) as response:
            record.status = response.status_code
            if response.status_code != 200:
                record.outcome = "refused"
                record.detail = (await response.aread()).decode(errors="replace")[:300]
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    continue
                choice = json.loads(data)["choices"][0]
                tokens += len(choice.get("token_ids") or [])
                if choice.get("finish_reason") is not None:
                    final = choice
        if final is None or not done:
            record.outcome = "truncated"
            record.detail = f"stream ended after {tokens} tokens without its final chunk"
            return
        classify_final(record, final, tokens)

    # ------------------------------------------------------------------ reading
    def lost(self) -> list[int]:
        """Logical requests whose last attempt neither succeeded nor ended in an error the
        client saw (an answer without an outcome: a bug of the load generator, or a hang cut
        short by stop())."""
        last: dict[int, Record] = {}
        for r in self.records:
            last[r.request] = r
        return [q for q, r in last.items() if r.outcome not in OUTCOMES]


def latency_percentiles(records: Sequence[Record], *qs: float) -> list[float]:
    """Latency quantiles (nearest rank) of the records that completed ``ok``."""
    lat = sorted(r.latency for r in records if r.outcome == "ok")
    if not lat:
        return [float("nan") for _ in qs]
    return [lat[min(len(lat) - 1, max(0, round(q * len(lat)) - 1))] for q in qs]


@dataclass
class GateRouter:
    """Which pods are in traffic, as a gateway that follows the pods' readiness would see
    it: a pod is a target while its readiness gate is True (and its Ready condition, where a
    kubelet reports one, is not False). Polls ``list_pods`` every ``interval`` seconds in a
    thread and keeps ``history``: (epoch seconds, pods in traffic) at every change."""

    list_pods: Callable[[], list[dict[str, Any]]]
    port: int
    interval: float = 0.05
    history: list[tuple[float, frozenset[str]]] = field(default_factory=list)
    _current: tuple[Target, ...] = ()
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def targets(self) -> tuple[Target, ...]:
        return self._current

    def poll(self) -> None:
        pods = self.list_pods()
        now = time.time()
        current = tuple(
            Target(p["metadata"]["name"], f"http://{p['status']['podIP']}:{self.port}")
            for p in sorted(pods, key=lambda p: p["metadata"]["name"])
            if in_traffic(p) and (p.get("status") or {}).get("podIP")
        )
        names = frozenset(t.pod for t in current)
        if not self.history or self.history[-1][1] != names:
            self.history.append((now, names))
        self._current = current

    def start(self) -> GateRouter:
        self.poll()
        self._thread = threading.Thread(target=self._loop, name="gate-router", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # a busy API server: poll again
                self.poll()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def out_of_traffic(self, pod: str) -> list[tuple[float, float]]:
        """The windows (from, to) the router saw ``pod`` out of traffic (to: inf if still)."""
        windows: list[tuple[float, float]] = []
        began: float | None = None
        for t, names in self.history:
            if pod not in names and began is None:
                began = t
            elif pod in names and began is not None:
                windows.append((began, t))
                began = None
        if began is not None:
            windows.append((began, float("inf")))
        return windows


def in_traffic(pod: dict[str, Any]) -> bool:
    conds = {
        c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or []
    }
    return conds.get(READINESS_GATE) == "True" and conds.get("Ready") != "False"
