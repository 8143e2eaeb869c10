"""TRL's experimental ``AsyncGRPOTrainer`` trains through Refit: rollouts keep coming from the
fleet while the trainer updates, and each sync refits the fleet with the operator's probe.

    from refit_client import RefitClient
    from refit_client.integrations.trl_async import RefitRolloutWorker, RefitWeightTransfer

    client = RefitClient(namespace="rl")
    transfer = RefitWeightTransfer(client, model, fleet_selector="app=rollout", port=8000,
                                   probe_token_ids=ids, rendezvous=("10.0.0.5", 29600))
    worker = RefitRolloutWorker(client, fleet_selector="app=rollout", port=8000,
                                prompts=texts, reward_funcs=[...], tokenizer=tok,
                                num_generations=8, max_tokens=64, max_staleness=2)
    trainer = AsyncGRPOTrainer(model=model, args=AsyncGRPOConfig(max_staleness=2, ...),
                               reward_funcs=[...], weight_transfer=transfer,
                               rollout_worker=worker, ...)

``RefitWeightTransfer`` (TRL's ``WeightTransferProtocol``): each ``send_weights(iterator)``
publishes the streamed tensors as ONE broadcast WeightRefit through ``RefitClient.broadcast``,
by default ``Rolling`` with ``maxUnavailable: 1`` and ``drainMode: keep``: at most one pod is
out of traffic at a time and its requests in flight are frozen and finished, so the fleet never
stops generating. The refit is gated by the operator's probe (a reference scored by the
trainer's own model); a failed or timed-out refit raises ``RefitFailed``/``RefitTimeout`` with
the operator's reason, out of TRL's weight sync, which stops training. ``pause()`` and
``resume()`` do nothing: pausing is the operator's, one pod at a time. Versions are
``<prefix>-v<N>``, N counting the syncs from 1 (the cold sync at train begin): TRL's own
``model_version`` after that sync.

``RefitRolloutWorker`` (TRL's ``RolloutWorkerProtocol``, in the trainer's process): threads
generate groups of ``num_generations`` completions on vLLM's token-in/token-out route
``/inference/v1/generate`` (pods started with ``--enable-scale-out``) of the Service, else of
the Ready pods the operator's traffic gate admits (``trl.rollout_endpoints``, any probed
version), score them with the reward functions and queue them. Each completion carries the
versions the pod **served** it with (vLLM's weight-version spans: with ``keep`` a completion
frozen by a refit names both versions), not the trainer's counter. The queue the trainer
drains (``StalenessQueue``) never hands over a sample whose served versions fall outside
``max_staleness`` of the version the consuming step trains from (``stale_reason``); it counts
each drop by its reason (``report()``). Generation never waits on the trainer: a full queue
drops its oldest sample for the new one (``evicted``). TRL's own check on ``model_version``
then sees the oldest served version, so it agrees.

TRL and torch are imported lazily (the operator's environment has neither).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from refit_operator.core import api

from ..client import RefitClient
from ..refit_document import default_name, parse_selector
from .trl import ROUTES, choice_tokens, fleet_groups, rollout_endpoints

if TYPE_CHECKING:
    from multiprocessing.queues import Queue as MPQueue

log = logging.getLogger(__name__)

# What a sync publishes unless the caller says otherwise: the fleet keeps generating.
ASYNC_SPEC: dict[str, Any] = {"strategy": "Rolling", "max_unavailable": 1}
ASYNC_SEQUENCE: dict[str, Any] = {"drainMode": "keep"}


# ------------------------------------------------------------------------- the staleness rule
def version_number(version: str, prefix: str) -> int | None:
    """N of ``<prefix>-v<N>`` (a version this run published), else None."""
    m = re.fullmatch(re.escape(prefix) + r"-v(\d+)", version)
    return int(m.group(1)) if m else None


def served_versions(choice: Mapping[str, Any], tokens: int) -> tuple[tuple[str, ...], str]:
    """The versions a completion's tokens were generated at, in order, from its weight-version
    spans, and why they cannot be told ("" when they can): no spans, or spans that do not
    cover every token."""
    spans = choice.get("weight_versions")
    if spans is None:
        return (), "no weight-version spans (the pod needs --enable-scale-out)"
    covered = sum(int(s["end"]) - int(s["start"]) for s in spans)
    if covered != tokens:
        return (), f"weight-version spans cover {covered} of {tokens} tokens"
    return tuple(dict.fromkeys(str(s["version"]) for s in spans)), ""


def stale_reason(served: Sequence[str], consuming: int, max_staleness: int, prefix: str) -> str:
    """Why a sample generated at ``served`` may not be trained on by a step that trains from
    ``<prefix>-v<consuming>`` ("" when it may): every version it was generated at is one this
    run published, none is newer than the consuming one, and the oldest is at most
    ``max_staleness`` versions behind it."""
    if not served:
        return "unknown: the versions it was generated at are unknown"
    numbers = [version_number(v, prefix) for v in served]
    foreign = [v for v, n in zip(served, numbers, strict=True) if n is None]
    if foreign:
        return f"foreign: generated at {foreign[0]}, not a version of this run ({prefix}-vN)"
    known = [n for n in numbers if n is not None]
    if max(known) > consuming:
        return f"ahead: generated at {prefix}-v{max(known)}, newer than {prefix}-v{consuming}"
    behind = consuming - min(known)
    if behind > max_staleness:
        return (
            f"stale: generated at {prefix}-v{min(known)}, {behind} versions behind "
            f"{prefix}-v{consuming} (max_staleness {max_staleness})"
        )
    return ""


def reason_kind(reason: str) -> str:
    """The kind of a ``stale_reason``/``served_versions`` reason, for the drop counts."""
    return reason.split(":", 1)[0] if reason.split(":", 1)[0] in DROP_KINDS else "spans"


DROP_KINDS = ("unknown", "foreign", "ahead", "stale")  # "evicted" is the full queue's


def plain_attention(model: Any) -> contextlib.AbstractContextManager[None]:
    """A forward of ``model`` with transformers' SDPA attention for the duration: TRL's async
    trainer loads the model with its tree attention, which needs the packed batch's tree."""

    @contextlib.contextmanager
    def switched() -> Iterator[None]:
        config = model.config
        before = config._attn_implementation
        config._attn_implementation = "sdpa"
        try:
            yield
        finally:
            config._attn_implementation = before

    return switched()


# ----------------------------------------------------------------------- the weight transfer
@dataclass
class SyncRecord:
    """One sync: the version published, its refit, and when it ran (time.monotonic())."""

    version: str
    refit: str
    began: float
    ended: float = 0.0
    phase: str = ""
    reason: str = ""
    tensors: int = 0


class RefitWeightTransfer:
    """TRL's ``weight_transfer`` (see the module's docstring). ``model`` is the trainer's model
    (its weights at each sync are the ones streamed): the probe reference is scored with it.
    ``AsyncGRPOTrainer`` builds its model from a path, so set it once the trainer is built
    (``transfer.model = trainer.model``); a sync without it raises.
    ``spec`` adds to or overrides the refit's spec keywords (RefitClient.broadcast);
    ``sequence`` in it merges over ``drainMode: keep``. ``keep_versions``: how many of the last
    published versions' weights to keep a copy of, for ``model_at`` (0: none)."""

    def __init__(
        self,
        client: RefitClient,
        model: Any = None,
        *,
        fleet_selector: str | Mapping[str, str],
        port: int,
        probe_token_ids: Sequence[Sequence[int]],
        rendezvous: tuple[str, int],
        version_prefix: str = "async",
        refit_timeout: float = 600,
        spec: Mapping[str, Any] | None = None,
        groups: api.Groups | Mapping[str, str] | None = None,
        keep_versions: int = 0,
    ) -> None:
        if not probe_token_ids:
            raise ValueError("probe_token_ids is empty: the operator's probe needs prompts")
        parse_selector(fleet_selector)  # a bad selector fails here, early
        self.client, self.model, self.selector, self.port = client, model, fleet_selector, port
        self.probe_token_ids = [list(ids) for ids in probe_token_ids]
        self.rendezvous, self.prefix, self.refit_timeout = rendezvous, version_prefix, refit_timeout
        given = dict(spec or {})
        sequence = {**ASYNC_SEQUENCE, **dict(given.pop("sequence", None) or {})}
        self.spec, self.groups = fleet_groups({**ASYNC_SPEC, **given, "sequence": sequence}, groups)
        self.syncs: list[SyncRecord] = []
        self.keep_versions = keep_versions
        self._kept: dict[str, dict[str, Any]] = {}  # version -> its tensors (copies)
        self._scratch: Any = None  # a copy of the model, holding _scratch_version's weights
        self._scratch_version = ""
        self._kept_lock = threading.Lock()

    @property
    def version(self) -> str:
        """The version the last sync published ("" before the first)."""
        return self.syncs[-1].version if self.syncs else ""

    def init_weight_transfer(self) -> None:
        """Nothing to set up: each sync opens its own rendezvous for the operator's rounds."""

    def pause(self) -> None:
        """The fleet keeps generating: the operator pauses pods one batch at a time."""

    def resume(self) -> None:
        """See ``pause``."""

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        """Publish the streamed tensors as one WeightRefit and wait for its verdict; raises
        ``RefitFailed``/``RefitTimeout`` (the operator's reason) unless it Succeeded."""
        from refit_worker import reference

        from ..client import RefitFailed, RefitTimeout

        if self.model is None:
            raise ValueError("RefitWeightTransfer.model is unset: set it to the trainer's model")
        version = f"{self.prefix}-v{len(self.syncs) + 1}"
        rec = SyncRecord(version, default_name(version), time.monotonic())
        # The trainer does not step while it syncs: the live tensors are the version's.
        tensors = {name: t.detach().cpu().contiguous() for name, t in iterator}
        rec.tensors = len(tensors)
        self._keep(version, tensors)
        with plain_attention(self.model):
            ref = reference.reference_from_model(
                self.model, self.probe_token_ids, version=version,
                tool="refit_client.integrations.trl_async",
            )  # fmt: skip
        self.syncs.append(rec)
        try:
            self.client.broadcast(
                tensors, version, fleet_selector=self.selector, rendezvous=self.rendezvous,
                reference=ref, timeout=self.refit_timeout, name=rec.refit, port=self.port,
                **self.spec,
            )  # fmt: skip
        except RefitFailed as e:
            rec.phase, rec.reason = e.phase, e.reason
            raise
        except RefitTimeout:
            rec.phase = "Timeout"
            raise
        finally:
            rec.ended = time.monotonic()
        rec.phase = "Succeeded"
        log.info("published %s (%s) in %.1f s", version, rec.refit, rec.ended - rec.began)

    def _keep(self, version: str, tensors: Mapping[str, Any]) -> None:
        if self.keep_versions <= 0:
            return
        with self._kept_lock:
            # Copies: the trainer's optimizer steps the live tensors in place after the sync.
            self._kept[version] = {name: t.clone() for name, t in tensors.items()}
            while len(self._kept) > self.keep_versions:
                del self._kept[next(iter(self._kept))]

    def model_at(self, version: str) -> Any:
        """A copy of the trainer's model holding the weights this transfer published as
        ``version`` (None when it no longer keeps them, or never published it): what the
        fleet served that version with, for the trainer-vs-fleet logprob mismatch. One copy (a
        transformers model of the same class and config), reloaded when asked for another
        version."""
        import copy

        with self._kept_lock:
            weights = self._kept.get(version)
            if weights is None:
                return None
            if self._scratch is None:
                # Built from the config, not deep-copied: TRL patches the model's forward with
                # a closure over the live model (add_fused_lm_head), which a copy would share.
                live = self.model
                self._scratch = type(live)(copy.deepcopy(live.config)).to(live.dtype)
                self._scratch.load_state_dict(live.state_dict())
                self._scratch.eval()
            if self._scratch_version != version:
                got = self._scratch.load_state_dict(weights, strict=False)
                if got.unexpected_keys:
                    raise ValueError(f"published tensors the model lacks: {got.unexpected_keys}")
                self._scratch_version = version
            return self._scratch

    def destroy(self) -> None:
        """Nothing held between syncs (the client is the caller's)."""


# ------------------------------------------------------------------------ the rollout worker
def _served_sample_class() -> type:
    """TRL's RolloutSample with what the fleet served it with (TRL imported lazily)."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    @dataclass
    class ServedSample(RolloutSample):
        served: tuple[str, ...] = ()
        unit: str = ""
        finished_at: float = 0.0
        served_reason: str = ""  # why ``served`` could not be told

    return ServedSample


@dataclass
class Consumed:
    """What the trainer consumed at one version: samples, their served versions, mismatch."""

    samples: int = 0
    served: Counter[str] = field(default_factory=Counter)
    staleness: Counter[int] = field(default_factory=Counter)
    max_abs_logprob_diff: float | None = None  # trainer vs fleet, at the version served
    mismatch_samples: int = 0  # the samples that went into max_abs_logprob_diff
    # Served at two versions (a keep refit froze it): its later tokens attended to KV the
    # earlier weights computed, which no single forward of the trainer reproduces.
    mixed_samples: int = 0


class StalenessQueue(queue.Queue[Any]):
    """The queue TRL's trainer drains: ``get`` hands over only samples ``stale_reason`` lets
    through for the version the trainer trains from now, dropping (and counting) the rest."""

    def __init__(self, worker: RefitRolloutWorker, maxsize: int) -> None:
        super().__init__(maxsize)
        self.worker = worker

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        while True:
            sample = super().get(block, timeout)
            if self.worker.admit(sample):
                return sample


class RefitRolloutWorker:
    """TRL's ``rollout_worker`` (see the module's docstring). ``prompts``: the prompt texts,
    cycled; ``reward_funcs`` are called as TRL calls them (``prompts``, ``completions``,
    ``completion_ids`` keywords). ``concurrency`` groups are generated at once (spread over
    the admitted units). When the queue is full the oldest sample in it is dropped (counted
    ``evicted``) for the new one: generation never waits on the trainer, and what the trainer
    takes is the freshest. ``model_at``: version -> the trainer's model at the weights it
    published as that version, or None (``RefitWeightTransfer.model_at`` with
    ``keep_versions``), to report per version trained from the largest |trainer logprob -
    fleet logprob| over the consumed samples served entirely at one version it still has (off
    by default: a forward per such sample)."""

    def __init__(
        self,
        client: RefitClient,
        *,
        fleet_selector: str | Mapping[str, str],
        port: int,
        prompts: Sequence[str],
        reward_funcs: Sequence[Callable[..., Sequence[float | None]]],
        tokenizer: Any,
        num_generations: int,
        max_tokens: int,
        max_staleness: int,
        version_prefix: str = "async",
        temperature: float = 1.0,
        sampling: Mapping[str, Any] | None = None,
        service_url: str | None = None,
        groups: api.Groups | Mapping[str, str] | None = None,
        concurrency: int = 2,
        queue_maxsize: int = 256,
        request_timeout: float = 120,
        model_at: Callable[[str], Any] | None = None,
    ) -> None:
        if not prompts:
            raise ValueError("prompts is empty")
        if max_staleness < 0:
            raise ValueError(f"max_staleness {max_staleness}: at least 0")
        self.client, self.port, self.service_url = client, port, service_url
        self.label_selector = parse_selector(fleet_selector).canonical()
        _, self.groups = fleet_groups({}, groups)
        self.prompts, self.reward_funcs, self.tok = list(prompts), list(reward_funcs), tokenizer
        self.n, self.max_staleness, self.prefix = num_generations, max_staleness, version_prefix
        self.params: dict[str, Any] = {
            "n": num_generations, "temperature": temperature, "max_tokens": max_tokens,
            "logprobs": 0, **(sampling or {}),
        }  # fmt: skip
        self.concurrency, self.model_at = concurrency, model_at
        self.http = httpx.Client(timeout=request_timeout)
        # Typed as TRL's RolloutWorkerProtocol says (its attributes are invariant).
        self.rollout_buffer: queue.Queue[Any] | MPQueue[Any] = StalenessQueue(self, queue_maxsize)
        self.metrics_queue: queue.Queue[Any] | MPQueue[Any] = queue.Queue(maxsize=4096)
        self.model_version = 0
        self.dropped: Counter[str] = Counter()  # reason kind -> samples
        self.drop_examples: dict[str, str] = {}  # reason kind -> its first full reason
        self.consumed: dict[int, Consumed] = {}
        # (when, unit, served, completion tokens) per completion, time.monotonic()
        self.finished: list[tuple[float, str, tuple[str, ...], int]] = []
        self._lock = threading.Lock()
        self._work = itertools.count()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._last_put = time.monotonic()
        self._sample_class: Any = None

    # ------------------------------------------------------------------- TRL's protocol
    def start(self) -> None:
        self._sample_class = _served_sample_class()
        self._last_put = time.monotonic()
        for i in range(self.concurrency):
            t = threading.Thread(target=self._run, name=f"refit-rollout-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        self.http.close()

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError(f"the rollout worker failed: {self._error}") from self._error
        idle = time.monotonic() - self._last_put
        if idle > stale_after_s:
            raise RuntimeError(f"the rollout worker queued nothing for {idle:.0f} s")

    # ------------------------------------------------------------------------ consuming
    def admit(self, sample: Any) -> bool:
        """Whether the trainer may train on ``sample`` now (``stale_reason`` against the
        version it trains from); a refused sample is counted by its reason."""
        consuming = self.model_version
        why = sample.served_reason or stale_reason(
            sample.served, consuming, self.max_staleness, self.prefix
        )
        if why:
            kind = reason_kind(why)
            with self._lock:
                self.dropped[kind] += 1
                self.drop_examples.setdefault(kind, why)
            log.info("not training on a sample from %s: %s", sample.unit, why)
            return False
        numbers = [version_number(v, self.prefix) or 0 for v in sample.served]
        with self._lock:
            step = self.consumed.setdefault(consuming, Consumed())
            step.samples += 1
            step.served.update(sample.served)
            step.staleness[consuming - min(numbers)] += 1
            step.mixed_samples += len(sample.served) > 1
        model = None
        if self.model_at is not None and len(sample.served) == 1:
            model = self.model_at(sample.served[0])
        if model is not None:
            diff = self._mismatch(model, sample)
            with self._lock:
                step.mismatch_samples += 1
                step.max_abs_logprob_diff = max(step.max_abs_logprob_diff or 0.0, diff)
        return True

    def _mismatch(self, model: Any, sample: Any) -> float:
        from .trl import max_abs_logprob_diff

        mask = sample.completion_mask.tolist()
        start = mask.index(1) if 1 in mask else len(mask)
        ids = sample.input_ids.tolist()
        with plain_attention(model):
            return max_abs_logprob_diff(
                model, [ids[:start]], [ids[start:]], [sample.old_log_probs.tolist()[start:]]
            )

    def report(self) -> dict[str, Any]:
        """What the run consumed and dropped: per version trained from, the samples, the
        versions they were served at, their staleness and the logprob mismatch; the drops by
        reason kind with one full reason each."""
        with self._lock:
            return {
                "maxStaleness": self.max_staleness,
                "dropped": dict(self.dropped),
                "dropExamples": dict(self.drop_examples),
                "consumed": {
                    v: {
                        "samples": c.samples,
                        "served": dict(c.served),
                        "staleness": {str(k): n for k, n in sorted(c.staleness.items())},
                        "maxAbsLogprobDiff": c.max_abs_logprob_diff,
                        "mismatchSamples": c.mismatch_samples,
                        "mixedVersionSamples": c.mixed_samples,
                    }
                    for v, c in sorted(self.consumed.items())
                },
            }

    # ----------------------------------------------------------------------- generating
    def endpoints(self) -> list[tuple[str, str]]:
        """(unit, base URL) to generate from: the Service, else every unit the traffic gate
        admits, at whatever probed version it serves."""
        if self.service_url:
            return [("service", self.service_url)]
        from kubernetes import client as k8s

        core: Any = k8s.CoreV1Api(self.client.api_client)
        items = core.list_namespaced_pod(self.client.namespace, label_selector=self.label_selector)
        pods = [self.client.api_client.sanitize_for_serialization(p) for p in items.items]
        return rollout_endpoints(pods, self.port, None, self.groups).urls

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                group = next(self._work)
                urls = self.endpoints()
                if not urls:  # every unit out of traffic at once: not what a keep refit does
                    time.sleep(0.2)
                    continue
                unit, url = urls[group % len(urls)]
                for sample in self._group(group, unit, url):
                    self._put(sample)
        except BaseException as e:  # surfaced by check_health, on the trainer's thread
            log.exception("the rollout worker failed")
            self._error = e

    def _put(self, sample: Any) -> None:
        while not self._stop.is_set():
            try:
                self.rollout_buffer.put_nowait(sample)
                self._last_put = time.monotonic()
                return
            except queue.Full:
                self._evict_oldest()

    def _evict_oldest(self) -> None:
        """Drop the queue's oldest sample, past the staleness check (queue.Queue's own get)."""
        try:
            old = queue.Queue.get(self.rollout_buffer, False)  # type: ignore[arg-type]
        except queue.Empty:
            return
        with self._lock:
            self.dropped["evicted"] += 1
            self.drop_examples.setdefault(
                "evicted",
                "evicted: the queue was full; the oldest sample, served at "
                + (", ".join(old.served) or "unknown versions"),
            )

    def _group(self, group: int, unit: str, url: str) -> list[Any]:
        """One prompt's ``n`` completions from one unit, scored, as samples."""
        import numpy as np

        prompt = self.prompts[group % len(self.prompts)]
        ids = list(self.tok(text=prompt)["input_ids"])
        resp = self.http.post(
            url + ROUTES["generate"], json={"token_ids": ids, "sampling_params": self.params}
        )
        resp.raise_for_status()
        done = time.monotonic()
        choices = list(resp.json()["choices"])
        completions, got = [], []
        for choice in choices:
            c_ids, c_lp = choice_tokens(choice)
            served, why = served_versions(choice, len(c_ids))
            got.append((c_ids, c_lp, served, why))
            completions.append(self.tok.decode(c_ids, skip_special_tokens=True))
        with self._lock:
            self.finished.extend((done, unit, g[2], len(g[0])) for g in got)
        columns = [
            [np.nan if r is None else float(r) for r in
             f(prompts=[prompt] * len(got), completions=completions,
               completion_ids=[g[0] for g in got])]
            for f in self.reward_funcs
        ]  # fmt: skip
        rewards = np.nansum(np.array(columns, dtype=float), axis=0)
        std = float(rewards.std())
        advantages = (rewards - rewards.mean()) / (std + 1e-8)
        out: list[Any] = []
        for (c_ids, c_lp, served, why), adv, reward in zip(got, advantages, rewards, strict=True):
            numbers = [version_number(v, self.prefix) for v in served]
            oldest = min((n for n in numbers if n is not None), default=-1)
            out.append(
                self._sample_class(
                    prompt=prompt, completion=completions[len(out)],
                    input_ids=np.asarray(ids + c_ids, dtype=np.int64),
                    completion_mask=np.asarray([0] * len(ids) + [1] * len(c_ids), dtype=np.int64),
                    old_log_probs=np.asarray([0.0] * len(ids) + c_lp, dtype=np.float32),
                    advantage=float(adv), model_version=oldest, group_id=group,
                    metrics={"reward": float(reward), "reward_std": std},
                    enqueued_at=time.time(), served=served, unit=unit, finished_at=done,
                    served_reason=why,
                )
            )  # fmt: skip
        return out
