"""Read-back checksums: what a pod's model holds after a load, and whether its peers agree.

The worker verifies the bytes it is given (manifest digests, a broadcast's promise) and the
probe scores a few prompts; neither sees a tensor the load path skipped, a post-load
transform that went wrong, or one pod's runtime weights differing from its peers'. The
``checksum`` step reads back, after every load or receive and before the probe, vLLM's own
per-parameter SHA-256 (``POST /weight_checker``) and the worker extension's digests of every
buffer that is not a parameter (``refit_buffer_digests``), folds them into one digest, and
asks :func:`judge` whether it agrees with what pods of the same layout hold at that version.

Pure: plain data in, decisions out (controller/steps.py does the calls; the reconcile loop
gathers the peers).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

from .api import STATUS_CHECKSUMS_LIMIT, VersionChecksum
from .podflow import Progress
from .reasons import Problem, Reason

# The pod's model differs from its peers' (or from the checksum recorded for that version and
# layout): final, since loading the same bytes again cannot fix a fault that loading made.
CHECKSUM_MISMATCH = Reason.WeightChecksumMismatch
LAYOUT_HEX = 12  # a layout names a set of tensor keys and a dtype: a short hash tells them apart
DIGEST_HEX = 32  # 128 bits of SHA-256: collisions are not the failure this guards against


@dataclass(frozen=True)
class Readback:
    """One pod's read-back: the layout its tensors have, and one digest over all of them."""

    layout: str
    digest: str
    tensors: int


def read_back(dtype: str, parameters: Mapping[str, str], buffers: Mapping[str, str]) -> Readback:
    """Fold the per-tensor digests into one. The layout is the dtype and the sorted keys (each
    worker's rank prefix and the tensor's name, so tensor- and pipeline-parallel shapes are
    layouts of their own): pods of one layout that loaded one version hold the same bytes."""
    keys = sorted(f"p:{k}" for k in parameters) + sorted(f"b:{k}" for k in buffers)
    layout = hashlib.sha256("\n".join([dtype, *keys]).encode()).hexdigest()[:LAYOUT_HEX]
    digests = {**{f"p:{k}": v for k, v in parameters.items()},
               **{f"b:{k}": v for k, v in buffers.items()}}  # fmt: skip
    body = "\n".join(f"{k}={digests[k]}" for k in keys)
    return Readback(layout, hashlib.sha256(body.encode()).hexdigest()[:DIGEST_HEX], len(keys))


@dataclass(frozen=True)
class Peer:
    """A pod's read-back at a version and layout."""

    pod: str
    digest: str
    confirmed: bool  # its probe passed on these weights


def peer(pod: str, p: Progress | None) -> Peer | None:
    """``pod``'s read-back as its pass record holds it; None where it holds none, or where
    the pod failed for disagreeing (no witness)."""
    if p is None or not p.checksum or p.reason == CHECKSUM_MISMATCH:
        return None
    passed = p.outcome == "Succeeded" or (p.probe is not None and p.probe.verdict == "Pass")
    return Peer(pod, p.checksum, passed)


@dataclass(frozen=True)
class Witnesses:
    """The read-backs a pod is judged against: pod names by (digest, probe passed), each in
    order of arrival, at one version and layout; ``me``, the pod judged, does not count."""

    groups: Mapping[tuple[str, bool], Collection[str]]
    me: str = ""

    @classmethod
    def of(cls, peers: Iterable[Peer], me: str = "") -> Witnesses:
        groups: dict[tuple[str, bool], dict[str, None]] = {}
        for p in peers:
            groups.setdefault((p.digest, p.confirmed), {})[p.pod] = None
        return cls(groups, me)

    def counts(self, confirmed: bool) -> dict[str, int]:
        """Pods by digest, in order of arrival: those whose probe passed, or all."""
        out: dict[str, int] = {}
        for (digest, passed), pods in self.groups.items():
            n = len(pods) - (self.me in pods)
            if n and (passed or not confirmed):
                out[digest] = out.get(digest, 0) + n
        return out

    def holders(self, digest: str, confirmed: bool, most: int) -> list[str]:
        """Up to ``most`` of the pods holding ``digest``, for a message."""
        out: list[str] = []
        for (d, passed), pods in self.groups.items():
            if d == digest and (passed or not confirmed):
                out.extend(islice((p for p in pods if p != self.me), most - len(out)))
        return out


class Readbacks:
    """Every pod's read-back as its record changes, grouped by (version, layout), then by
    (digest, probe passed). Judging a pod against them costs the number of distinct digests,
    not of pods: a scan of every record for each pod's judgement made a 10,000-pod AllAtOnce
    refit quadratic."""

    def __init__(self) -> None:
        self._at: dict[str, tuple[str, str, Peer]] = {}  # pod -> (version, layout, read-back)
        self._groups: dict[tuple[str, str], dict[tuple[str, bool], dict[str, None]]] = {}

    def put(self, pod: str, p: Progress | None) -> None:
        """``pod``'s record now (None: it has none, or is gone)."""
        old = self._at.pop(pod, None)
        if old is not None:
            version, layout, was = old
            self._groups[version, layout][was.digest, was.confirmed].pop(pod, None)
        now = peer(pod, p)
        if p is None or now is None:
            return
        self._at[pod] = (p.version, p.layout, now)
        at = self._groups.setdefault((p.version, p.layout), {})
        at.setdefault((now.digest, now.confirmed), {})[pod] = None

    def reset(self, records: Iterable[tuple[str, Progress | None]]) -> None:
        """Every pod's record, as listed: what was put before and is not among them is gone."""
        self._at.clear()
        self._groups.clear()
        for pod, p in records:
            self.put(pod, p)

    def witnesses(self, version: str, layout: str, me: str) -> Witnesses:
        return Witnesses(self._groups.get((version, layout), {}), me)


def judge(
    own: Readback, version: str, recorded: str | None, witnesses: Witnesses
) -> Problem | None:
    """The problem when ``own`` disagrees; None when it agrees or is the first.

    The checksum recorded for (version, layout) wins: it is what pods served with a passed
    probe. Without one, the peers whose probe passed decide, else all peers: the digest most
    of them hold, the earliest on a tie. So under AllAtOnce the first pod to read back sets
    the reference its probe then vouches for, and a pod that disagrees fails before its probe
    (two pods that disagree fail the later one: the refit then stops on it either way)."""
    where = f"version {version}, layout {own.layout}"
    if recorded:
        if own.digest == recorded:
            return None
        return Problem(
            CHECKSUM_MISMATCH,
            f"runtime weights {own.digest[:12]} differ from {recorded[:12]}, the checksum "
            f"recorded for {where} ({own.tensors} tensors read back)",
        )
    confirmed = True
    counts = witnesses.counts(confirmed)
    if not counts:
        confirmed, counts = False, witnesses.counts(False)
    if not counts:
        return None
    agreed = max(counts, key=counts.__getitem__)  # the first of the largest: the earliest
    if own.digest == agreed:
        return None
    count = counts[agreed]
    named = sorted(witnesses.holders(agreed, confirmed, 3))
    shown = ", ".join(named) + (f" and {count - len(named)} more" if count > len(named) else "")
    return Problem(
        CHECKSUM_MISMATCH,
        f"runtime weights {own.digest[:12]} differ from {agreed[:12]}, which {shown} "
        f"hold{'s' if count == 1 else ''} at {where} ({own.tensors} tensors read back)",
    )


def recorded(entries: Sequence[VersionChecksum], version: str, layout: str) -> str | None:
    for e in entries:
        if e.version == version and e.layout == layout:
            return e.digest
    return None


def status_checksums(
    old: Sequence[VersionChecksum], records: Iterable[Progress], uid: str
) -> list[VersionChecksum]:
    """status.checksums: one digest per (version, layout) that this refit's pods served with
    a passed probe, kept once written (a pod that moves on does not take it away); newest
    first, at most api.STATUS_CHECKSUMS_LIMIT (a refit has a version and its rollback's, each
    in a few layouts)."""
    out = list(old)
    have = {(e.version, e.layout) for e in out}
    for p in records:
        if p.uid != uid or p.outcome != "Succeeded" or not p.checksum:
            continue
        if (p.version, p.layout) not in have:
            have.add((p.version, p.layout))
            out.insert(0, VersionChecksum(version=p.version, layout=p.layout, digest=p.checksum))
    return out[:STATUS_CHECKSUMS_LIMIT]
