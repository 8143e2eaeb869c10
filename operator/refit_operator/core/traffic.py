"""Time out of traffic, the headline figure of a refit: per pod, the seconds from its pass
setting the readiness condition (refit.rollout.dev/weights-ready) False to setting it True
again, and their summary over a refit's pods (status.outOfTraffic). Pure.

Only pods a pass put back into traffic are measured (podflow.out_of_traffic_seconds): a pod
still out, or left out by a failed pass, has no figure yet; the RefitPodsOutOfTraffic alert and
the refit_fleet_pods_out_of_traffic gauge are about those.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from .api_status import OutOfTrafficSummary
from .podflow import Progress, out_of_traffic_seconds

# Milliseconds: finer than a status reader needs, and a stable value once measured.
DIGITS = 3


def pod_seconds(progress: Progress) -> float | None:
    """A pod's seconds out of traffic in this pass, rounded for the status (PodResult's
    outOfTrafficSeconds); None while it is out, when the pass left it out or never took it
    out."""
    seconds = out_of_traffic_seconds(progress)
    return None if seconds is None else round(seconds, DIGITS)


def summarize_seconds(measured: Iterable[tuple[str, float | None]]) -> OutOfTrafficSummary:
    """The summary of (pod name, seconds out of traffic) pairs; None seconds are skipped. The
    worst pod of two equally long is the first by name."""
    values = sorted(((s, n) for n, s in measured if s is not None), key=lambda t: (-t[0], t[1]))
    if not values:
        return OutOfTrafficSummary()
    worst, worst_pod = values[0]
    return OutOfTrafficSummary(
        pods=len(values),
        worst_seconds=round(worst, DIGITS),
        median_seconds=round(statistics.median(s for s, _ in values), DIGITS),
        worst_pod=worst_pod,
    )


def summarize_out_of_traffic(
    items: Iterable[tuple[str, Progress]], before: OutOfTrafficSummary | None = None
) -> OutOfTrafficSummary:
    """status.outOfTraffic from (pod name, progress of this refit's pass) pairs: the pods the
    refit put back into traffic, their worst and median seconds out, and the worst pod.

    before: the summary already written, or None. A summary of fewer pods than ``before`` is
    not written over it (``before`` is returned): a pod that moved on to a newer refit or left
    the fleet no longer carries this refit's record, and its time out still counted. Pass
    None where the new passes replace the old ones (a rollback's)."""
    summary = summarize_seconds((name, pod_seconds(p)) for name, p in items)
    if before is not None and summary.pods < before.pods:
        return before.model_copy()
    return summary
