"""Every renewal of a Lease, as the API server stored it: how the tests and the scale bench
see whether a leader renewed in time, from outside its process."""

from __future__ import annotations

import itertools
import threading
from typing import Any

from kubernetes import client as k8s
from kubernetes import watch as k8s_watch


class LeaseRenewals:
    """Every renewal of one Lease as the API server stored it: a thread watches the Lease
    and keeps each new ``spec.renewTime`` (epoch seconds; the leader stamps it as it sends
    the renewal) in ``times``, from the record it finds at the start on."""

    def __init__(self, api: k8s.ApiClient, ns: str, name: str) -> None:
        self.coord: Any = k8s.CoordinationV1Api(api)
        self.ns, self.name = ns, name
        self.times: list[float] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lease-watch", daemon=True)
        self._thread.start()

    def _seen(self, lease: Any) -> None:
        renewed = lease.spec.renew_time if lease.spec is not None else None
        if renewed is not None:
            stamp = renewed.timestamp()
            if not self.times or stamp != self.times[-1]:
                self.times.append(stamp)

    def _list(self, selector: str) -> str:
        listed = self.coord.list_namespaced_lease(self.ns, field_selector=selector)
        for lease in listed.items:
            self._seen(lease)
        return str(listed.metadata.resource_version)

    def _watch(self) -> None:
        selector = f"metadata.name={self.name}"
        version = self._list(selector)
        while not self._stopping.is_set():
            for event in k8s_watch.Watch().stream(
                self.coord.list_namespaced_lease,
                self.ns,
                field_selector=selector,
                resource_version=version,
                timeout_seconds=1,
            ):
                if event["type"] == "ERROR":  # too old a version: start again from a list
                    version = self._list(selector)
                    break
                self._seen(event["object"])
                version = event["object"].metadata.resource_version

    def stop(self) -> list[float]:
        self._stopping.set()
        self._thread.join(timeout=10)
        return list(self.times)


def max_renewal_gap(renewals: list[float], start: float, end: float) -> tuple[float, int]:
    """The longest time without a renewal within [start, end] (epoch seconds), counting from
    the last renewal before ``start`` (or ``start``) and up to ``end``; and how many renewals
    fell inside the window."""
    before = [t for t in renewals if t <= start]
    inside = [t for t in renewals if start < t <= end]
    marks = [before[-1] if before else start, *inside, end]
    return max(b - a for a, b in itertools.pairwise(marks)), len(inside)
