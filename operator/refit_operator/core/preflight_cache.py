"""The fleet preflight's answers kept between refits: each pod's refit_info and /get_world_size,
taken again from memory by the next refit of an unchanged fleet instead of asked again.

What a pod answers there is fixed for the life of its vLLM process: its capabilities, unsafe
reasons, parallel layout, LoRA, drafter, vocabulary and model length are start-time settings,
and only a new process answers otherwise. A new process is another Pod object (uid), a
container restart (restarts; for a pod group also a follower replaced: incarnation) or another
image, all read from the Pod object: an answer is reused only while all four are as they were
when it was given (``Identity``), and a fresh refit_info that differs from the kept one (any
field but weight_version, which refits change) drops the world size kept with it. Pods that
are no longer listed are dropped, and the fleets kept are bounded (``Fleets``): nothing grows
with the number of refits seen. Memory only: a restarted operator asks every pod again.

Whether the preflight's forward pass over the probe reference can be skipped is decided here
too (``reference_unchecked``). Pure: plain data in, plain data out.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from refit_worker.contract import RefitInfo

from .podview import PodView
from .sequences import FLOWS, Source, Step

# Fleets (namespace, selector, groups) whose answers one operator process keeps: the least
# recently preflighted ones beyond it are forgotten (they are asked again, as after a restart).
MAX_FLEETS = 256


@dataclass(frozen=True)
class Identity:
    """The process that gave an answer, as the Pod object shows it."""

    uid: str
    restarts: int
    incarnation: str
    image: str

    @classmethod
    def of(cls, pod: PodView) -> Identity:
        return cls(pod.uid, pod.restarts, pod.incarnation, pod.image)


@dataclass(frozen=True)
class PodAnswers:
    """One pod's preflight answers, and the process that gave them."""

    identity: Identity
    info: RefitInfo
    world_size: int | None = None  # None: not asked since this refit_info
    # The /v1 credentials (key_digest) a probe reference was scored with on this process:
    # it accepted them, so a forward pass adds nothing the static check does not
    # (reference_unchecked). None: no reference scored here yet.
    scored_with: str | None = None


def key_digest(api_key: str | None) -> str:
    """What is kept of vLLM's --api-key: enough to tell another key, not the key."""
    return hashlib.sha256((api_key or "").encode()).hexdigest()[:16]


def same_process_info(a: RefitInfo, b: RefitInfo) -> bool:
    """Two refit_info answers of the same process: equal but for the weight version."""
    return replace(a, weight_version="") == replace(b, weight_version="")


def reusable(kept: PodAnswers | None, pod: PodView) -> PodAnswers | None:
    """``kept`` when it answers for the pod as it is now (same process, both answers held)."""
    if kept is None or kept.world_size is None or kept.identity != Identity.of(pod):
        return None
    return kept


def refreshed(kept: PodAnswers | None, pod: PodView, info: RefitInfo) -> PodAnswers:
    """The entry after a fresh refit_info from ``pod``: what was kept with an equal answer of
    the same process stays (its world size, the credentials it scored with); anything else
    starts again from this answer alone."""
    identity = Identity.of(pod)
    if kept is not None and kept.identity == identity and same_process_info(kept.info, info):
        return replace(kept, info=info)
    return PodAnswers(identity, info)


class FleetAnswers:
    """The answers kept for one fleet, by pod name."""

    def __init__(self) -> None:
        self.pods: dict[str, PodAnswers] = {}

    def keep_only(self, pods: Iterable[PodView]) -> None:
        """Drop the pods no longer listed, and answers of another process than the listed."""
        listed = {p.name: p for p in pods}
        self.pods = {
            name: a
            for name, a in self.pods.items()
            if name in listed and a.identity == Identity.of(listed[name])
        }

    def get(self, pod: PodView) -> PodAnswers | None:
        """Both answers, given by the pod's process now; None: ask the pod."""
        return reusable(self.pods.get(pod.name), pod)

    def of_process(self, pod: PodView) -> PodAnswers | None:
        """What the pod's process now answered (its world size perhaps not yet)."""
        kept = self.pods.get(pod.name)
        return kept if kept is not None and kept.identity == Identity.of(pod) else None

    def saw_info(self, pod: PodView, info: RefitInfo) -> None:
        self.pods[pod.name] = refreshed(self.pods.get(pod.name), pod, info)

    def saw_world_size(self, pod: PodView, size: int) -> None:
        kept = self.pods.get(pod.name)
        if kept is not None and kept.identity == Identity.of(pod):
            self.pods[pod.name] = replace(kept, world_size=size)

    def scored(self, pod: PodView, api_key: str | None) -> None:
        kept = self.pods.get(pod.name)
        if kept is not None and kept.identity == Identity.of(pod):
            self.pods[pod.name] = replace(kept, scored_with=key_digest(api_key))


FleetKey = tuple[str, str, str]  # namespace, canonical selector, groups (spec.fleet.groups)


class Fleets:
    """The answers of every fleet this process preflighted, the MAX_FLEETS latest."""

    def __init__(self, limit: int = MAX_FLEETS) -> None:
        self.limit = limit
        self._fleets: OrderedDict[FleetKey, FleetAnswers] = OrderedDict()

    def of(self, key: FleetKey, pods: Iterable[PodView]) -> FleetAnswers:
        """The fleet's answers, down to the pods listed now."""
        fleet = self._fleets.pop(key, None) or FleetAnswers()
        fleet.keep_only(pods)
        self._fleets[key] = fleet
        while len(self._fleets) > self.limit:
            self._fleets.popitem(last=False)
        return fleet

    def peek(self, key: FleetKey) -> FleetAnswers | None:
        """The fleet's answers as kept, without pruning them (a lookup per pass)."""
        return self._fleets.get(key)

    def __len__(self) -> int:
        return len(self._fleets)


def probes_before_traffic(source: Source) -> bool:
    """Every pass of this source probes the new weights before it vouches for them (the probe
    step comes before ready): a reference the model cannot score fails there, and no pod is
    ever back in traffic on weights it did not score."""
    steps = FLOWS[source].steps
    return Step.probe in steps and steps.index(Step.probe) < steps.index(Step.ready)


def reference_fits(prompts: Sequence[Sequence[int]], info: RefitInfo) -> str | None:
    """Why the model ``info`` describes may not score these token ids (None: it scores them):
    vLLM refuses an id outside its vocabulary and a prompt not shorter than max_model_len
    (one token is generated). Unknown sizes (an older worker) decide nothing."""
    if info.vocab_size <= 0 or info.max_model_len <= 0:
        return "the worker does not report its vocabulary size and model length"
    for i, ids in enumerate(prompts):
        if not ids or len(ids) >= info.max_model_len:
            return f"prompt {i} has {len(ids)} tokens (max_model_len {info.max_model_len})"
        if min(ids) < 0 or max(ids) >= info.vocab_size:
            return f"prompt {i} holds token ids outside the vocabulary of {info.vocab_size}"
    return None


def reference_unchecked(
    prompts: Sequence[Sequence[int]],
    answers: Sequence[PodAnswers | None],
    api_key: str | None,
    source: Source,
) -> str | None:
    """Why the preflight must score the reference with a forward pass; None when it need not.

    The forward pass fails a refit whose reference the model cannot score before any pod is
    touched. It may be skipped only where it can tell nothing more: every pass probes before
    its pod is back in traffic (the probe scores the reference anyway), every pod's kept
    refit_info (kept or asked now) shows a model that scores these token ids (vocabulary,
    prompt lengths), and a pod of the fleet has already scored a reference with these /v1
    credentials in its current process (what the forward pass checks beyond the token ids:
    a 401 is ProbeUnauthorized)."""
    if not probes_before_traffic(source):
        return "a pass may serve before its probe"
    if not answers or any(a is None for a in answers):
        return "a pod's refit_info is not known"
    kept = [a for a in answers if a is not None]
    for a in kept:
        why = reference_fits(prompts, a.info)
        if why is not None:
            return why
    digest = key_digest(api_key)
    if not any(a.scored_with == digest for a in kept):
        return "no pod scored a reference with these credentials yet"
    return None


def admitted_identities(pods: Iterable[PodView], names: Iterable[str]) -> Mapping[str, Identity]:
    """The pods a preflight admitted (``names``), each with the process it admitted."""
    by_name = {p.name: p for p in pods}
    return {n: Identity.of(by_name[n]) for n in names if n in by_name}
