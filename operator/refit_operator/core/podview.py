"""A pod as the operator sees it (PodView), parsed from the Pod object the API server returns:
its address, containers, readiness condition, restarts, and the pass records it carries
(podflow.Progress, claim.Claim). What the decisions need of a pod, and nothing they decide.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from refit_worker.contract import READINESS_GATE, READY_PATH

from .claim import CLAIM_ANNOTATION, Claim
from .podflow import ADAPTER_PROGRESS_PREFIX, PROGRESS_ANNOTATION, Progress
from .reasons import Problem


@dataclass(frozen=True)
class PodView:
    """A pod as the operator sees it: what the decisions need, parsed from the Pod object."""

    name: str
    ip: str
    has_gate: bool
    running: bool
    deleting: bool
    ready: bool  # the weights-ready condition is True
    restarts: int
    progress: Progress | None
    uid: str = ""  # a pod recreated under the same name (StatefulSet) is another pod
    labels: dict[str, str] = field(default_factory=dict)
    claim: Claim | None = None  # the pass that drives the pod now
    resource_version: str = ""  # as listed: the claim is taken conditional on it
    # vLLM answers, as the kubelet knows it (containers_up_in): False while a container
    # starts or restarts (vLLM still loading, its port refusing connections).
    containers_up: bool = True
    # A pod group (spec.fleet.groups; core/groups.py) as one replica: the leader's view, its
    # followers by name (gated with it), and what keeps the group from being refitted.
    members: tuple[str, ...] = ()
    group_problem: Problem | None = None
    incarnation: str = ""  # the followers' identity (groups.units): "" for a pod alone
    # The records of the LoRA adapters' passes, by adapter name (podflow.progress_annotation);
    # ``progress`` is the base weights' record, or an adapter's in a view ``on_track``.
    adapter_records: Mapping[str, Progress] = field(default_factory=dict)
    # The track ``progress`` is the record of ("" the base weights), and in a view on an
    # adapter's track the base weights' record, which the gate reads whatever the track.
    track: str = ""
    base_record: Progress | None = None
    # Some pod of the unit has its weights-ready condition True (``ready`` is all of them):
    # a group half in traffic is withdrawn whole (core/gate.py).
    some_ready: bool | None = None
    # What the containers run (images_in): another image is another process, whose refit_info
    # the fleet preflight does not take from an earlier answer (core/preflight_cache.py).
    image: str = ""

    def on_track(self, track: str) -> PodView:
        """The pod as a refit of ``track`` (WeightRefitSpec.track) sees it: that track's
        record as ``progress``, so that every decision reads the record its passes write."""
        if track == self.track:
            return self
        records = self.records
        return replace(self, progress=records.get(track), track=track, base_record=records.get(""))

    @property
    def records(self) -> dict[str, Progress]:
        """Every track's record on the pod, by track ("" the base weights): what the gate
        decides from (core/gate.py)."""
        base = self.progress if not self.track else self.base_record
        out = {k: v for k, v in self.adapter_records.items() if k}
        if self.track and self.progress is not None:
            out[self.track] = self.progress
        elif self.track:
            out.pop(self.track, None)
        if base is not None:
            out[""] = base
        return out

    def with_record(self, progress: Progress) -> PodView:
        """The pod with ``progress`` as the record of its track (a pass's next write)."""
        track = progress.track
        if track == self.track:
            return replace(self, progress=progress)
        if not track:
            return replace(self, base_record=progress)
        return replace(self, adapter_records={**self.adapter_records, track: progress})

    @property
    def any_ready(self) -> bool:
        """Some pod of the unit is in traffic (for a pod alone: ``ready``)."""
        return self.ready if self.some_ready is None else self.some_ready

    def same_run(self, p: Progress) -> bool:
        """``p`` was recorded in the container run that runs now: no container restarted
        since, and, for a pod group, no follower was replaced either (its weights, and the
        group's, went with it)."""
        return p.restarts == self.restarts and p.incarnation == self.incarnation

    @property
    def startable(self) -> bool:
        """A new pass may begin: the pod runs, has an address and its containers are up
        (a pass begun while vLLM starts would spend its retries on refused connections)."""
        return self.running and bool(self.ip) and self.containers_up and not self.deleting

    @property
    def vetted(self) -> bool:
        """The pod may be sent the admin token (it travels in clear to the pod's IP): it is
        listed by the fleet's selector, Running, with a pod IP, and declares the readiness
        gate. A pod in another phase may still show an IP that is no longer its own (a
        finished pod keeps its status.podIP while the address goes to another pod)."""
        return self.running and bool(self.ip) and self.has_gate

    def verified(self, version: str) -> bool:
        """At ``version`` with a passed probe and no container restart since."""
        p = self.progress
        return (
            p is not None
            and p.outcome == "Succeeded"
            and p.version == version
            and self.same_run(p)
            and self.ready
        )

    @property
    def may_be_paused(self) -> bool:
        """A pass of any track took the pod out of traffic in the container that runs now and
        neither succeeded nor put it back: vLLM may still be paused or asleep (a DrainTimeout fails
        closed with the pod paused, a failed load leaves it asleep), so a completion sent to
        it queues until something resumes it. A container restarted since is a new process,
        not paused."""
        return any(
            bool(p.left_traffic)
            and p.outcome != "Succeeded"
            and not p.restored
            and self.same_run(p)
            for p in self.records.values()  # whichever track's pass left it so
        )

    @property
    def serving(self) -> str:
        """The version the pod serves with a passed probe ("" if none): the one its last pass
        brought it to, or the one a refused pass put it back to."""
        p = self.progress
        if p is None or not self.ready or not self.same_run(p):
            return ""
        if p.outcome == "Succeeded":
            return p.version
        return p.serving if p.restored else ""

    @property
    def serving_path(self) -> str:
        """The checkpoint ``serving`` was loaded from ("" if none, or a broadcast's)."""
        p = self.progress
        if p is None or not self.serving:
            return ""
        return p.path if p.outcome == "Succeeded" else p.serving_path

    @classmethod
    def from_pod(cls, doc: Mapping[str, Any]) -> PodView:
        """From a Pod object as the API server returns it (a dict)."""
        meta, spec, status = doc["metadata"], doc.get("spec", {}), doc.get("status", {})
        gates = {g.get("conditionType") for g in spec.get("readinessGates") or []}
        conds = {c.get("type"): c for c in status.get("conditions") or []}
        restarts = sum(c.get("restartCount", 0) for c in status.get("containerStatuses") or [])
        annotations = meta.get("annotations") or {}
        return cls(
            name=meta["name"],
            ip=status.get("podIP") or "",
            has_gate=READINESS_GATE in gates,
            running=status.get("phase") == "Running",
            deleting=bool(meta.get("deletionTimestamp")),
            ready=conds.get(READINESS_GATE, {}).get("status") == "True",
            restarts=restarts,
            uid=meta.get("uid", ""),
            progress=Progress.from_annotation(annotations.get(PROGRESS_ANNOTATION)),
            labels=dict(meta.get("labels") or {}),
            claim=Claim.from_annotation(annotations.get(CLAIM_ANNOTATION)),
            resource_version=meta.get("resourceVersion", ""),
            containers_up=containers_up_in(spec, status),
            image=images_in(spec, status),
            adapter_records={
                key.removeprefix(ADAPTER_PROGRESS_PREFIX): record
                for key, text in annotations.items()
                if key.startswith(ADAPTER_PROGRESS_PREFIX)
                and (record := Progress.from_annotation(text)) is not None
            },
        )


def images_in(spec: Mapping[str, Any], status: Mapping[str, Any]) -> str:
    """The images the pod's containers run, by container name: the kubelet's imageID (the
    digest it pulled) where it reports one, else the image it or the spec names."""
    named = {str(c.get("name", "")): str(c.get("image", "")) for c in spec.get("containers") or []}
    for c in status.get("containerStatuses") or []:
        name = str(c.get("name", ""))
        named[name] = str(c.get("imageID") or c.get("image") or named.get(name, ""))
    return ",".join(f"{name}={image}" for name, image in sorted(named.items()))


def containers_up_in(spec: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Whether a pod's containers answer, from the Pod object.

    Normally the kubelet's ContainersReady condition. A pod whose readiness probe is the
    worker's /refit/ready (refit_worker.readiness) is not ready until a pass vouches for its
    weights, so waiting for ContainersReady would wait for ourselves: there every container
    must have *started* instead (containerStatuses[].started, which a startupProbe on /health
    holds False until vLLM answers). No condition at all (a test bed without a kubelet)
    counts as up."""
    probes = [
        ((c.get("readinessProbe") or {}).get("httpGet") or {}).get("path", "")
        for c in spec.get("containers") or []
    ]
    if any(str(p).rstrip("/") == READY_PATH for p in probes):
        statuses = status.get("containerStatuses") or []
        return bool(statuses) and all(c.get("started") is True for c in statuses)
    conds = {c.get("type"): c for c in status.get("conditions") or []}
    return conds.get("ContainersReady", {}).get("status") != "False"
