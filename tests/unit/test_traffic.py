"""traffic.py: a refit's time out of traffic per pod and over its pods (status.outOfTraffic)."""

from __future__ import annotations

from dataclasses import replace

from refit_operator.core import api_status, podflow, traffic
from refit_operator.core.podflow import Progress
from refit_operator.core.sequences import STEPS


def passed(left: float, back: float, *, serving: str = "") -> Progress:
    """A pass that took the pod out of traffic at ``left`` and put it back at ``back``; a pod
    that served (``serving``) staged for 5 s before, in traffic."""
    began = left - 5.0 if serving else left
    p = podflow.start("wr", "u1", "v2", "/c/v2", now=began, serving=serving)
    for step in STEPS:
        p = podflow.step_done(p, step, 0.1, left if step == STEPS[0] else back)
    return p


def test_pod_seconds_from_leaving_traffic_to_coming_back_rounded_to_ms():
    # A pod that served keeps serving while staging: the clock starts when staging is done.
    p = passed(100.0, 112.3456789, serving="v1")
    assert p.started == 95.0 and p.left_traffic == 100.0 and p.outcome == "Succeeded"
    assert traffic.pod_seconds(p) == 12.346


def test_pods_not_back_in_traffic_have_no_figure():
    in_flight = podflow.start("wr", "u1", "v2", "/c/v2", now=100.0)
    failed = podflow.step_failed(in_flight, "stage", "ManifestMismatch", "sha", 130.0, retries=2)
    assert failed.outcome == "Failed" and not failed.restored
    assert traffic.pod_seconds(in_flight) is None
    assert traffic.pod_seconds(failed) is None  # fail closed: still out
    # A refused load put back to serving its weights: measured, although the pass Failed.
    restored = replace(failed, restored=True, finished=145.0)
    assert traffic.pod_seconds(restored) == 45.0


def test_summary_worst_median_and_pods():
    items = [
        ("c", passed(100.0, 104.0)),
        ("a", passed(100.0, 130.5)),
        ("b", passed(100.0, 110.0)),
        ("d", podflow.start("wr", "u1", "v2", "/c/v2", now=100.0)),  # still out: not counted
    ]
    got = traffic.summarize_out_of_traffic(items)
    assert got == api_status.OutOfTrafficSummary(
        pods=3, worst_seconds=30.5, median_seconds=10.0, worst_pod="a"
    )
    # An even count: the median is the mean of the middle two.
    even = traffic.summarize_out_of_traffic(items[:2])
    assert (even.pods, even.median_seconds, even.worst_pod) == (2, 17.25, "a")


def test_summary_of_no_measured_pod_is_empty_and_ties_go_to_the_first_name():
    assert traffic.summarize_out_of_traffic([]) == api_status.OutOfTrafficSummary()
    tie = traffic.summarize_seconds([("z", 5.0), ("m", 5.0), ("x", None)])
    assert (tie.pods, tie.worst_pod, tie.worst_seconds) == (2, "m", 5.0)


def test_summary_never_drops_pods_already_counted():
    """A pod that moved on to a newer refit no longer carries this refit's record: the summary
    already written stays until at least as many pods are measured again."""
    before = api_status.OutOfTrafficSummary(
        pods=3, worst_seconds=40.0, median_seconds=9.0, worst_pod="x"
    )
    two = [("a", passed(100.0, 105.0)), ("b", passed(100.0, 107.0))]
    assert traffic.summarize_out_of_traffic(two, before) == before
    three = [*two, ("c", passed(100.0, 109.0))]
    assert traffic.summarize_out_of_traffic(three, before).worst_pod == "c"
    # None (a rollback's passes replace the forward ones): the new pods alone.
    assert traffic.summarize_out_of_traffic(two, None).pods == 2
