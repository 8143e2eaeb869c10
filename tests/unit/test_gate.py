"""The one traffic gate (core/gate.py): a pod is in traffic only when everything it serves has a
passed probe in this run, whatever pass ended last. One table over the records of every track
and the members of a group; docs/concepts.md, "One gate over many tracks and groups", shows the
same table. Plain data, no server."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from refit_operator.core import podflow
from refit_operator.core.gate import adapter_missing, base_moved_on, gate, pass_readiness
from refit_operator.core.podflow import Progress, base_key
from refit_operator.core.podview import PodView
from refit_operator.core.reasons import Problem, Reason
from refit_operator.core.sequences import Step

from tests.fixtures.refits import NOW, done, pod


def base(version: str = "v2", **over: object) -> Progress:
    p = done(podflow.start("wr-base", "u-base", version, f"/ckpt/{version}", NOW))
    return replace(p, **over)  # type: ignore[arg-type]


def adapter(on: Progress | None = None, version: str = "s2", **over: object) -> Progress:
    """A Succeeded pass of adapter ``policy`` probed on base record ``on``."""
    p = podflow.start("wr-lora", "u-lora", version, f"/lora/{version}", NOW + 1,
                      source="adapter", adapter="policy")  # fmt: skip
    if on is not None:
        p = replace(p, base_version=_served(on), base_pass=base_key(on))
    return replace(done(p), **over)  # type: ignore[arg-type]


def _served(b: Progress) -> str:
    return b.version if b.outcome == "Succeeded" else b.serving


def failed(p: Progress, reason: str = "LogprobDrift") -> Progress:
    return replace(p, outcome="Failed", reason=reason, message="mean over", left_traffic=NOW)


B = base()
# A newer pass of the base weights: Succeeded at v3, or at v2 again, having left traffic (its
# drain unloaded every adapter); refused while it staged (never left traffic).
B3 = replace(base("v3"), uid="u-base3", started=NOW + 5, left_traffic=NOW + 5)
B2_AGAIN = replace(base("v2"), uid="u-base2", started=NOW + 5, left_traffic=NOW + 5)
STAGING_REFUSED = replace(
    podflow.start("wr-b3", "u-b3", "v3", "/ckpt/v3", NOW + 5, serving="v2"),
    outcome="Failed", reason="ManifestMismatch", finished=NOW + 6, step=Step.stage,
)  # fmt: skip
A = adapter(B)


def unit(
    base_rec: Progress | None, adapters: dict[str, Progress] | None = None, **over: Any
) -> PodView:
    return pod("p0", base_rec, adapter_records=adapters or {}, **over)


GROUP: dict[str, Any] = {"members": ("p0-1",), "incarnation": "f1"}


def grouped(p: Progress) -> Progress:
    return replace(p, incarnation="f1")


# (case, unit, in traffic, reason)
CASES: list[tuple[str, PodView, bool, str]] = [
    ("base probed", unit(B), True, Reason.ProbePassed),
    ("no pass ever probed the base", unit(None), False, Reason.NotProbed),
    ("base failed", unit(failed(B, "WeightChecksumMismatch")), False, "WeightChecksumMismatch"),
    # issue 41, 1: an adapter's passing probe never lets in a pod whose base failed
    ("base failed, adapter probed",
     unit(failed(B, "WeightChecksumMismatch"), {"policy": A}), False, "WeightChecksumMismatch"),
    ("base mid-pass, out of traffic", unit(replace(B, outcome="", step=Step.load,
                                                   left_traffic=NOW)), False, Reason.Refitting),
    ("base staging beside what it serves",
     unit(podflow.start("wr", "u", "v3", "/ckpt/v3", NOW, serving="v2")), True,
     Reason.ProbePassed),
    ("base restored after a refused load", unit(replace(
        failed(B, "ManifestMismatch"), restored=True, serving="v1")), True,
     Reason.PreviousWeights),
    ("base refused while staging", unit(STAGING_REFUSED), True, Reason.ProbePassed),
    ("container restarted since the base pass", unit(B, restarts=1), False,
     Reason.ContainerRestarted),
    ("a track never refit on this pod", unit(B, {}), True, Reason.ProbePassed),
    ("adapter probed on this base", unit(B, {"policy": A}), True, Reason.ProbePassed),
    ("two adapters, one failed", unit(B, {"a": A, "policy": failed(A)}), False, "LogprobDrift"),
    # issue 41, 2: a later base pass (or another adapter's) never lets in a failed adapter
    ("adapter failed after its swap", unit(B, {"policy": failed(A)}), False, "LogprobDrift"),
    ("adapter failed, the base refit since", unit(B3, {"policy": failed(A)}), False,
     "LogprobDrift"),
    ("adapter failed, then the container restarted and the base came back",
     unit(replace(B3, restarts=1), {"policy": failed(A)}, restarts=1), True, Reason.ProbePassed),
    ("adapter staging beside what serves", unit(B, {"policy": replace(
        A, outcome="", step=Step.probeStaged, left_traffic=0.0)}), True, Reason.ProbePassed),
    ("adapter swapping", unit(B, {"policy": replace(
        A, outcome="", step=Step.swap, left_traffic=NOW + 2)}), False, Reason.Refitting),
    # issue 41, 3: a refused first adapter changes nothing the pod serves
    ("first adapter refused", unit(B, {"policy": replace(
        failed(A, "AdapterInvalid"), restored=True, serving="", left_traffic=0.0)}), True,
     Reason.ProbePassed),
    ("adapter probed on an older base version: unloaded, not served",
     unit(B3, {"policy": A}), True, Reason.ProbePassed),
    ("adapter probed on this version, the base reloaded since",
     unit(B2_AGAIN, {"policy": A}), True, Reason.ProbePassed),
    ("adapter probed on this version, a base pass refused while staging",
     unit(STAGING_REFUSED, {"policy": A}), True, Reason.ProbePassed),
    ("adapter lost to a restart, the base back at its version",
     unit(replace(B2_AGAIN, restarts=1), {"policy": A}, restarts=1), True,
     Reason.ProbePassed),
    ("adapter record from before records named their base", unit(B, {"policy": adapter()}),
     True, Reason.ProbePassed),
    ("adapter probed before any base pass, one since", unit(B, {"policy": replace(
        adapter(), base_pass=podflow.NO_BASE)}), True, Reason.ProbePassed),
    # issue 41, 5: a group serves only as a whole
    ("group, every member in the run recorded", unit(grouped(B), **GROUP), True,
     Reason.ProbePassed),
    ("group, a member replaced", unit(grouped(B), members=("p0-1",), incarnation="f2"), False,
     Reason.MemberReplaced),
    ("group, a member restarted", unit(grouped(B), restarts=1, **GROUP), False,
     Reason.ContainerRestarted),
    ("group, a member Pending", unit(grouped(B), running=False, **GROUP), False,
     Reason.MemberNotRunning),
    ("group, a member being deleted", unit(grouped(B), deleting=True, **GROUP), False,
     Reason.MemberNotRunning),
    ("group without its leader", unit(grouped(B), group_problem=Problem(
        Reason.GroupLeaderMissing, "no leader"), **GROUP), False, Reason.GroupLeaderMissing),
]  # fmt: skip


@pytest.mark.parametrize(("case", "u", "ready", "reason"), CASES, ids=[c[0] for c in CASES])
def test_the_gate_over_every_track_and_member(case: str, u: PodView, ready: bool, reason: str):
    g = gate(u)
    assert (g.ready, g.reason) == (ready, reason), g.message


def test_the_message_names_the_track_that_holds_the_pod_out():
    g = gate(unit(B3, {"policy": failed(A)}))
    assert "adapter policy s2 failed" in g.message
    g = gate(unit(grouped(B), members=("p0-1",), incarnation="f2"))
    assert "group p0" in g.message


def test_the_same_gate_whichever_track_a_refit_looks_at():
    u = unit(failed(B, "WeightChecksumMismatch"), {"policy": A})
    assert gate(u.on_track("policy")) == gate(u)
    assert gate(u.on_track("other")) == gate(u)


def test_in_traffic_the_condition_carries_the_words_of_the_pass_that_ended():
    u = unit(B, {"policy": A})
    assert gate(u, focus="policy").message == "adapter policy s2 probed"
    assert gate(u).message == "weights v2 probed"


def test_a_pass_writes_what_the_gate_says_of_the_whole_pod():
    """The writers' view (runner: claim, records, the last write): a pass that runs beside what
    serves leaves the condition as it is; its last write is the gate over every track."""
    u = unit(B, {"policy": failed(A)})
    staging = podflow.start("wr", "u", "v3", "/ckpt/v3", NOW, serving="v2")
    held = pass_readiness(u, staging)
    assert held is not None and not held.ready and held.reason == "LogprobDrift"
    ok = unit(B)
    assert pass_readiness(ok, staging) is None  # in traffic: nothing to write yet
    ended = pass_readiness(u, base("v3"))
    assert ended is not None and not ended.ready and "adapter policy" in ended.message
    assert pass_readiness(ok, base("v3")) == podflow.Readiness(
        True, Reason.ProbePassed, "weights v3 probed"
    )
    # An adapter pass on a pod whose base failed never sets the condition True.
    bad = unit(failed(B, "WeightChecksumMismatch")).on_track("policy")
    g = pass_readiness(bad, A)
    assert g is not None and not g.ready and g.reason == "WeightChecksumMismatch"


def test_an_adapter_the_pod_lost_is_its_refits_to_load_again():
    """Lost to a restart or to a reload of the same base version, an adapter is not served (it
    holds nothing out) and is missing: its refit counts the pod to do (decision.pod_state).
    Unloaded because the base moved on to another version, it is not missing: its refit no
    longer answers for the pod (base_moved_on)."""
    assert adapter_missing(unit(B2_AGAIN), A)
    assert adapter_missing(unit(replace(B2_AGAIN, restarts=1), restarts=1), A)
    assert adapter_missing(unit(B), replace(adapter(), base_pass=podflow.NO_BASE))
    assert not adapter_missing(unit(B), A)
    assert not adapter_missing(unit(STAGING_REFUSED), A)
    assert not adapter_missing(unit(B3), A) and base_moved_on(unit(B3), A)
    assert not adapter_missing(unit(B2_AGAIN), failed(A))  # failed: held out, not missing
