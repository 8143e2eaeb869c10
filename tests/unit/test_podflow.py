import json
from dataclasses import replace

import pytest
from refit_operator.core import claim, podflow, sequences, times
from refit_operator.core.podflow import Finished, Progress, RunStep, WaitUntil
from refit_operator.core.podview import PodView
from refit_operator.core.probe import ProbeOutcome
from refit_operator.core.sequences import STEPS, Step
from refit_worker.fence import MAX_FENCE, format_fence


def fresh() -> Progress:
    return podflow.start("wr", "uid-1", "v2", "/ckpt/v2", now=100.0, restarts=3)


def parsed(annotation: str) -> Progress:
    """A record that must read back (from_annotation reads an unreadable one as None)."""
    p = Progress.from_annotation(annotation)
    assert p is not None, annotation
    return p


def readiness_of(p: Progress) -> podflow.Readiness:
    """The readiness a pass sets (None only where the pass leaves the condition as it is)."""
    r = podflow.readiness(p)
    assert r is not None, p
    return r


def test_steps_in_the_documented_order():
    assert STEPS == (
        "stage", "drain", "sleep", "wakeWeights", "load", "receive", "wakeKV", "resetCache",
        "stampVersion", "checksum", "probe", "ready",
    )  # fmt: skip


def test_a_step_is_the_word_in_status_metrics_and_the_annotation():
    """Step members are named by their values, and serialize as the plain words."""
    assert all(step.name == step.value for step in Step)
    assert {*STEPS, *sequences.ADAPTER_STEPS, sequences.RESTORE} == set(Step)
    assert sequences.RESTORE == "restore"
    p = replace(fresh(), step=Step.wakeWeights)
    assert json.loads(p.to_annotation())["step"] == "wakeWeights"
    back = Progress.from_annotation(p.to_annotation())
    assert back is not None and back.step == Step.wakeWeights
    assert podflow.next_action(back, 101.0) == RunStep(Step.wakeWeights)


def test_walk_every_step_to_success():
    p = fresh()
    for step in STEPS:
        assert podflow.next_action(p, 101.0) == RunStep(step)
        p = podflow.step_done(p, step, 0.5, 101.0)
    assert p.outcome == "Succeeded" and p.step == ""
    assert set(p.step_seconds) == set(STEPS)
    assert podflow.next_action(p, 102.0) == Finished("Succeeded")


def test_out_of_order_step_is_refused():
    with pytest.raises(ValueError):
        podflow.step_done(fresh(), Step.load, 1.0, 1.0)


def test_retries_back_off_then_fail_closed():
    p = fresh()
    p = podflow.step_failed(p, Step.stage, "HttpError", "500", now=200.0, retries=2)
    assert p.outcome == "" and p.not_before == 201.0
    assert podflow.next_action(p, 200.5) == WaitUntil(201.0)
    assert podflow.next_action(p, 201.0) == RunStep(Step.stage)
    p = podflow.step_failed(p, Step.stage, "HttpError", "500", now=201.0, retries=2)
    assert p.not_before == 203.0
    p = podflow.step_failed(p, Step.stage, "HttpError", "500", now=203.0, retries=2)
    assert p.outcome == "Failed" and p.reason == "HttpError" and p.attempts == 3


def test_worker_rejection_is_final_at_once():
    p = podflow.step_failed(fresh(), Step.stage, "ManifestMismatch", "sha", now=1.0, retries=5)
    assert p.outcome == "Failed"


def test_probe_verdicts():
    p = fresh()
    passed = podflow.probe_judged(p, ProbeOutcome("Pass", "ProbePassed", "", nll=2.3), 5.0)
    assert passed.outcome == "" and passed.probe is not None
    assert (passed.probe.verdict, passed.probe.nll) == ("Pass", 2.3)
    inc = podflow.probe_judged(p, ProbeOutcome("Inconclusive", "ProbeNaN", "nan"), 5.0)
    assert inc.outcome == "Inconclusive" and inc.reason == "ProbeNaN"
    assert podflow.probe_judged(p, ProbeOutcome("Fail", "NllDrift", ""), 5.0).outcome == "Failed"


def test_annotation_round_trip_and_garbage():
    p = podflow.step_done(fresh(), Step.stage, 0.1, 1.0)
    assert Progress.from_annotation(p.to_annotation()) == p
    assert Progress.from_annotation("{not json") is None
    assert Progress.from_annotation('{"unknown": 1}') is None
    assert Progress.from_annotation('"a string"') is None
    assert Progress.from_annotation(None) is None


def test_the_probe_is_typed_in_memory_and_camel_case_on_the_pod():
    outcome = ProbeOutcome("Pass", "ProbePassed", "", 2.3, 2.31, 0.01, 0.02, 40)
    p = podflow.probe_judged(fresh(), outcome, 5.0)
    doc = json.loads(p.to_annotation())
    # The shape status.pods[].probe has, and records written by older operators hold.
    assert doc["probe"] == {
        "verdict": "Pass", "nll": 2.3, "referenceNll": 2.31, "meanAbsLogprobDiff": 0.01,
        "maxAbsLogprobDiff": 0.02, "tokens": 40,
    }  # fmt: skip
    assert Progress.from_annotation(p.to_annotation()) == p
    # An older record's probe, as written: read into the model with what it holds.
    doc["probe"] = {"verdict": "Inconclusive", "tokens": 0}
    back = Progress.from_annotation(json.dumps(doc))
    assert back is not None and back.probe is not None
    assert back.probe.verdict == "Inconclusive"
    assert back.probe.model_fields_set == {"verdict", "tokens"}
    doc["probe"] = {"verdict": "Maybe"}  # not a verdict: an unreadable record
    assert Progress.from_annotation(json.dumps(doc)) is None


def test_load_read_back_guard():
    assert podflow.load_needed("v1", "v2")
    assert not podflow.load_needed("v2", "v2")


def test_backoff_is_bounded():
    assert podflow.backoff(1) == 1.0
    assert podflow.backoff(50) == podflow.BACKOFF_MAX_SECONDS


def test_sleep_level_zero_skips_sleep_and_wakes():
    for source in ("checkpoint", "broadcast"):
        at_one = [s for s in STEPS if sequences.step_applies(s, 1, source)]
        at_zero = [s for s in STEPS if sequences.step_applies(s, 0, source)]
        assert [s for s in at_one if s not in at_zero] == [
            Step.sleep,
            Step.wakeWeights,
            Step.wakeKV,
        ]
        assert sequences.step_applies(Step.sleep, 2, source)


def test_a_checkpoint_loads_and_a_broadcast_receives():
    # The default source is a checkpoint: every step but the broadcast's receive.
    assert [s for s in STEPS if not sequences.step_applies(s, 1)] == [Step.receive]
    assert [s for s in STEPS if not sequences.step_applies(s, 1, "checkpoint")] == [Step.receive]
    # A broadcast has no directory to stage or load: it receives instead, and runs the rest.
    assert [s for s in STEPS if not sequences.step_applies(s, 1, "broadcast")] == [
        Step.stage,
        Step.load,
    ]
    assert [s for s in STEPS if not sequences.step_applies(s, 0, "broadcast")] == [
        Step.stage, Step.sleep, Step.wakeWeights, Step.load, Step.wakeKV,
    ]  # fmt: skip
    # The receive follows the wake of the weights and precedes the KV cache's, as the load.
    assert STEPS.index(Step.receive) == STEPS.index(Step.load) + 1


def _recorded(p: Progress, now: float) -> tuple[list[Step], Progress]:
    """Walk every step from the pass's first: the steps whose completion is recorded, and the
    pass at the end."""
    recorded = []
    for step in STEPS[STEPS.index(Step(p.step)) :]:
        after = podflow.step_done(p, step, 0.1, now)
        if podflow.must_record(p, after):
            recorded.append(step)
        p = after
    return recorded, p


def test_progress_is_recorded_where_a_write_has_a_reason_only():
    # Start is recorded by the caller (the claim). A pod out of traffic from the first write:
    # nothing more until the end (its stage, repeated after a restart, changes nothing served).
    recorded, _ = _recorded(fresh(), 1.0)
    assert recorded == [Step.ready]
    # A pod that serves through the staging: once staged (the record that takes it out of
    # traffic, before the drain), and at the end.
    recorded, _ = _recorded(serving_pass(), 1.0)
    assert recorded == [Step.stage, Step.ready]


def test_failed_tries_and_verdicts_are_recorded():
    p = podflow.step_done(fresh(), Step.stage, 0.1, 1.0)
    p = podflow.step_done(p, Step.drain, 0.1, 1.0)
    retry = podflow.step_failed(p, Step.sleep, "SleepTimeout", "slow", now=2.0, retries=3)
    assert retry.outcome == "" and podflow.must_record(p, retry)
    failed = podflow.probe_judged(p, ProbeOutcome("Fail", "NllDrift", "drift"), 3.0)
    assert podflow.must_record(p, failed)


def test_read_back_before_load_only_when_a_load_may_have_run():
    at_load = fresh()
    assert not podflow.must_read_back(at_load, resumed=False)
    assert podflow.must_read_back(at_load, resumed=True)
    retried = podflow.step_failed(at_load, Step.load, "LoadTimeout", "slow", now=2.0, retries=3)
    assert podflow.must_read_back(retried, resumed=False)


def test_readiness_follows_the_pass():
    p = fresh()
    assert podflow.readiness(p) == podflow.Readiness(False, "Refitting", "refit to v2 in progress")
    for step in STEPS[:-1]:
        p = podflow.step_done(p, step, 0.1, 1.0)
        assert not readiness_of(p).ready
    done = podflow.step_done(p, Step.ready, 0.1, 1.0)
    assert podflow.readiness(done) == podflow.Readiness(True, "ProbePassed", "weights v2 probed")
    failed = podflow.probe_judged(p, ProbeOutcome("Fail", "NllDrift", "nll 9.1 vs 2.0"), 3.0)
    assert podflow.readiness(failed) == podflow.Readiness(
        False, "NllDrift", "NllDrift: nll 9.1 vs 2.0"
    )


def test_claim_round_trips_and_unreadable_is_none():
    c = claim.Claim(refit="wr", uid="u", fence=(3 << 32) | 5, holder="op0-1")
    assert claim.Claim.from_annotation(c.to_annotation()) == c
    for bad in (
        None,
        "",
        "{",
        '{"refit": "wr"}',
        '{"refit":"a","uid":"u","fence":"x","holder":"h"}',
    ):
        assert claim.Claim.from_annotation(bad) is None


def test_claim_names_its_holders_lease_and_an_older_claim_still_reads():
    c = claim.Claim("wr", "u", 9, "op-a", lease="refit-a/refit-operator", lease_seconds=15)
    assert claim.Claim.from_annotation(c.to_annotation()) == c
    old = '{"fence":7,"holder":"op0-1","refit":"wr","uid":"u"}'  # before claims named it
    assert claim.Claim.from_annotation(old) == claim.Claim("wr", "u", 7, "op0-1", "", 0)
    assert claim.Claim.from_annotation("[1, 2]") is None


def test_claim_fence_grows_with_every_claim_of_a_pod_and_tops_the_lease_scheme():
    """Each claim of a pod is written conditional on a resourceVersion written after the
    claim before it: its token is higher, whichever process or Lease took it. Tokens of the
    Lease-epoch scheme (leaseTransitions << 32 | pass) a pod may remember from an older
    operator stay below all of them, and every token fits the pods' 64 bits."""
    given = ("1", "41", "42", "1000000", str(2**63 - 1))
    tokens = [t for t in map(claim.claim_fence, given) if t is not None]
    assert len(tokens) == len(given) and tokens == sorted(set(tokens))
    assert tokens[0] == claim.FENCE_BASE + 1
    lease_scheme = ((2**31 - 1) << 32) | (2**32 - 1)  # the largest epoch and pass
    assert lease_scheme < claim.FENCE_BASE + 1
    assert tokens[-1] == MAX_FENCE
    assert format_fence(tokens[-1]) == str(MAX_FENCE)
    # Not etcd's integers: the pass takes the Lease-epoch token instead.
    for odd in ("", "abc", "12a", "-1", "+5", "١٢", str(2**63), "1" * 30):
        assert claim.claim_fence(odd) is None, odd


def test_newer_than_breaks_timestamp_ties_by_name():
    p = podflow.start("b", "u", "v", "/p", 0.0, created="2026-01-01T00:00:00Z")
    assert p.newer_than("2026-01-01T00:00:00Z", "a")
    assert not p.newer_than("2026-01-01T00:00:00Z", "c")
    assert not p.newer_than("2026-01-02T00:00:00Z", "a")


def test_newer_than_follows_the_creation_stamps_of_one_second_not_the_names():
    second = "2026-01-01T00:00:00Z"
    nine = times.creation_order(second, times.stamp(1_767_225_600_100000000))
    ten = times.creation_order(second, times.stamp(1_767_225_600_200000000))
    p = podflow.start("refit-step-10", "u10", "v10", "/p", 0.0, created=ten)
    assert p.newer_than(nine, "refit-step-9")
    q = podflow.start("refit-step-9", "u9", "v9", "/p", 0.0, created=nine)
    assert not q.newer_than(ten, "refit-step-10")
    # A record written before stamps existed (the bare second) is the older one of its second.
    old = podflow.start("refit-step-99", "u", "v", "/p", 0.0, created=second)
    assert not old.newer_than(nine, "refit-step-9") and p.newer_than(second, "refit-step-99")


def serving_pass() -> Progress:
    """A pass on a pod that serves v1 with a passed probe."""
    return podflow.start("wr", "uid-1", "v2", "/ckpt/v2", now=100.0, serving="v1")


def test_a_serving_pod_stays_in_traffic_while_staging_only():
    p = serving_pass()
    assert p.in_traffic and podflow.readiness(p) is None and p.left_traffic == 0.0
    staged = podflow.step_done(p, Step.stage, 4.0, 104.0)
    assert not staged.in_traffic and staged.left_traffic == 104.0
    assert podflow.readiness(staged) == podflow.Readiness(
        False, "Refitting", "refit to v2 in progress"
    )
    assert podflow.must_record(p, staged)  # the record that takes the pod out of traffic
    # How the worker staged it goes into the pod's condition: over the budget, it says so.
    note = "12.0 GB exceeds the staging budget 8.0 GiB: the load reads the files again"
    disk = podflow.step_done(replace(p, staging=note), Step.stage, 4.0, 104.0)
    assert readiness_of(disk).message == f"refit to v2 in progress; {note}"
    # A retried stage keeps the pod in traffic; a refused one leaves it there, untouched.
    retry = podflow.step_failed(p, Step.stage, "StageTimeout", "slow", now=101.0, retries=3)
    assert retry.in_traffic and podflow.readiness(retry) is None
    refused = podflow.step_failed(p, Step.stage, "ManifestMismatch", "sha", now=101.0, retries=3)
    assert refused.outcome == "Failed" and podflow.readiness(refused) is None
    assert podflow.out_of_traffic_seconds(refused) is None


def test_a_pod_not_serving_leaves_traffic_in_the_first_write():
    p = fresh()  # no probed version: never Ready on the strength of an older probe
    assert not p.in_traffic and p.left_traffic == 100.0
    assert podflow.readiness(p) == podflow.Readiness(False, "Refitting", "refit to v2 in progress")


def _at_load(p: Progress) -> Progress:
    for step in (Step.stage, Step.drain, Step.sleep, Step.wakeWeights):
        p = podflow.step_done(p, step, 1.0, 110.0)
    return p


def test_a_load_refused_before_the_model_was_touched_restores_the_pod():
    p = _at_load(serving_pass())
    back = podflow.step_failed(
        p, Step.load, "CheckpointChanged", "shard rewritten", 111.0, retries=3
    )
    assert (
        back.step == sequences.RESTORE and back.outcome == "" and back.reason == "CheckpointChanged"
    )
    assert podflow.next_action(back, 111.0) == RunStep(sequences.RESTORE)
    assert readiness_of(back).ready is False  # out of traffic until restored
    done = podflow.restored(back, 112.0)
    assert done.outcome == "Failed" and done.restored and done.in_traffic
    ready = podflow.readiness(done)
    assert ready is not None and ready.ready and ready.reason == "PreviousWeights"
    assert "serving v1 again" in ready.message and "CheckpointChanged" in ready.message
    assert podflow.out_of_traffic_seconds(done) == pytest.approx(2.0)
    # A restore that fails ends the pass with the pod out of traffic (fail closed).
    lost = podflow.step_failed(back, sequences.RESTORE, "CheckpointChanged", "x", 112.0, retries=3,
                               final=True)  # fmt: skip
    assert lost.outcome == "Failed" and not lost.restored and readiness_of(lost).ready is False


def test_no_restore_after_the_model_was_touched_or_without_served_weights():
    p = _at_load(serving_pass())
    touched = podflow.step_failed(p, Step.load, "LoadFailed", "boom", 111.0, retries=0)
    assert touched.outcome == "Failed" and not touched.restored
    assert readiness_of(touched).ready is False
    unserved = podflow.step_failed(_at_load(fresh()), Step.load, "CheckpointChanged", "x", 111.0,
                                   retries=3)  # fmt: skip
    assert unserved.outcome == "Failed" and unserved.step == Step.load
    with pytest.raises(ValueError):
        podflow.restored(p, 1.0)


def test_out_of_traffic_seconds_of_a_succeeded_pass():
    p = serving_pass()
    for step in STEPS:
        p = podflow.step_done(p, step, 1.0, 100.0 + 10 * STEPS.index(step))
    assert p.outcome == "Succeeded" and p.left_traffic == 100.0
    # The drain's end is recorded: what was in flight then was waited for, aborted or frozen.
    assert p.drained_at == 100.0 + 10 * STEPS.index("drain")
    # Out from the stage (t=100) to the ready step, 10 s per step after it.
    assert podflow.out_of_traffic_seconds(p) == pytest.approx(10.0 * (len(STEPS) - 1))
    assert podflow.out_of_traffic_seconds(serving_pass()) is None


def _pod(progress: Progress | None, *, ready: bool = True, restarts: int = 0) -> PodView:
    return PodView("p", "10.0.0.1", True, True, False, ready, restarts, progress)


def test_what_a_pod_serves():
    done = podflow.start("wr", "u", "v1", "/v1", 0.0)
    for step in STEPS:
        done = podflow.step_done(done, step, 0.1, 1.0)
    assert _pod(done).serving == "v1"
    assert _pod(done, ready=False).serving == ""
    assert _pod(done, restarts=1).serving == ""  # the container restarted: weights lost
    assert _pod(None).serving == ""
    back = podflow.restored(
        podflow.step_failed(_at_load(serving_pass()), Step.load, "CheckpointChanged", "x", 1.0,
                            retries=0),
        2.0,
    )  # fmt: skip
    assert _pod(back).serving == "v1"


def broadcast_pass(serving: str = "v1") -> Progress:
    """A broadcast pass (no path) on a pod that serves ``serving``, at its receive step."""
    p = podflow.start("wr", "uid-1", "v2", "", now=100.0, serving=serving, source="broadcast")
    for step in (Step.drain, Step.sleep, Step.wakeWeights, Step.load):
        p = podflow.step_done(p, step, 0.0, 110.0)
    assert p.step == Step.receive
    return p


def test_the_source_survives_the_annotation():
    p = broadcast_pass()
    assert p.source == "broadcast"
    assert Progress.from_annotation(p.to_annotation()) == p
    assert fresh().source == "checkpoint"
    # A record written before the field existed reads as a checkpoint pass.
    doc = json.loads(fresh().to_annotation())
    del doc["source"]
    assert Progress.from_annotation(json.dumps(doc)) == fresh()


def test_a_receive_refused_before_the_model_was_touched_restores_the_pod():
    for reason in ("TransferMismatch", "TransferFailed", "TrainerTimeout", "ManifestInvalid",
                   "TensorMismatch"):  # fmt: skip
        back = podflow.step_failed(broadcast_pass(), Step.receive, reason, "x", 111.0, retries=3,
                                   final=True)  # fmt: skip
        assert back.step == sequences.RESTORE and back.outcome == "", reason
        done = podflow.restored(back, 112.0)
        assert done.restored and readiness_of(done).reason == "PreviousWeights", reason


def test_a_receive_that_may_have_touched_the_model_fails_closed():
    for reason in ("LoadFailed", "ReceiveTimeout", "PodUnreachable"):
        p = podflow.step_failed(broadcast_pass(), Step.receive, reason, "x", 111.0, retries=3,
                                final=True)  # fmt: skip
        assert p.outcome == "Failed" and p.step == Step.receive and not p.restored, reason
        assert readiness_of(p).ready is False
    # Without weights it served with a passed probe there is nothing to go back to.
    p = podflow.step_failed(broadcast_pass(serving=""), Step.receive, "TransferFailed", "x", 111.0,
                            retries=3, final=True)  # fmt: skip
    assert p.outcome == "Failed" and not p.restored


def test_a_broadcast_pass_leaves_traffic_in_its_first_write():
    p = podflow.start("wr", "uid-1", "v2", "", now=100.0, serving="v1", source="broadcast")
    # Nothing to stage: the claim's write takes the pod out, the pass starts at the drain, and
    # nothing is recorded between that write and the end.
    assert p.step == Step.drain and not p.in_traffic and p.left_traffic == 100.0
    assert readiness_of(p) == podflow.Readiness(False, "Refitting", "refit to v2 in progress")
    recorded, p = _recorded(p, 101.0)
    assert recorded == [Step.ready]
    assert p.outcome == "Succeeded" and p.left_traffic == 100.0
    # What it served is still recorded: a receive refused untouched goes back to serving it.
    assert p.serving == "v1"


# Load refusals the worker raises before it touches the model, and failures after which the
# model may have been touched (the worker may have begun, or still be running, the load).
UNTOUCHED = sorted(sequences.UNTOUCHED_LOAD_CODES)
TOUCHING = ["LoadFailed", "LoadTimeout", "PodUnreachable", "WorkerHttpError",
            "WorkerProtocolError"]  # fmt: skip


def _tries(p: Progress, reasons: list[str], *, retries: int, restart: bool) -> Progress:
    """The load failing with ``reasons`` in turn (each try as the runner records it: final
    for a coded refusal other than LoadFailed), the record round-tripped through the
    annotation between tries and, with ``restart``, taken up by a new operator each time."""
    for i, reason in enumerate(reasons):
        assert p.step == Step.load and not p.finished_pass, (reasons, i, p)
        final = reason in sequences.UNTOUCHED_LOAD_CODES
        p = podflow.step_failed(p, Step.load, reason, f"try {i}", 111.0 + i, retries=retries,
                                final=final)  # fmt: skip
        if p.finished_pass or p.step == sequences.RESTORE:
            break
        assert podflow.must_record(_at_load(serving_pass()), p)  # the fact is on the pod
        p = parsed(p.to_annotation())
        if restart:
            p = podflow.resumed(p)
    return p


@pytest.mark.parametrize("restart", [False, True])
@pytest.mark.parametrize("first", TOUCHING)
@pytest.mark.parametrize("last", UNTOUCHED)
def test_a_refusal_after_a_try_that_may_have_touched_the_model_never_restores(
    first: str, last: str, restart: bool
):
    p = _tries(_at_load(serving_pass()), [first, last], retries=2, restart=restart)
    assert p.touched and p.outcome == "Failed" and p.step == Step.load and not p.restored, p
    assert p.reason == last and "may have changed the model" in p.message
    ready = podflow.readiness(p)
    assert ready is not None and ready.ready is False and ready.reason == last
    with pytest.raises(ValueError):
        podflow.restored(replace(p, step=sequences.RESTORE, outcome=""), 120.0)


def test_every_order_of_load_failures_keeps_an_untouched_restore_only():
    """Every sequence of up to three failures of the load, with and without an operator
    restart between tries: the pod goes back to what it served only when the first try was
    refused before the model was touched; otherwise the pass ends with the pod out of
    traffic, or goes on to a load (and its probe)."""
    import itertools

    for restart in (False, True):
        for n in (1, 2, 3):
            for reasons in itertools.product(TOUCHING[:2] + UNTOUCHED[:2], repeat=n):
                p = _tries(_at_load(serving_pass()), list(reasons), retries=2, restart=restart)
                if reasons[0] in UNTOUCHED:
                    assert p.step == sequences.RESTORE and not p.touched, reasons
                    assert readiness_of(podflow.restored(p, 120.0)).ready
                else:
                    assert p.touched and p.step != sequences.RESTORE, reasons
                    assert readiness_of(p).ready is False, reasons


def test_a_pass_resumed_past_its_stage_counts_the_model_as_touched():
    staged = podflow.step_done(serving_pass(), Step.stage, 1.0, 104.0)
    for p in (staged, _at_load(serving_pass())):
        # The last operator may have been inside the load when it stopped.
        back = podflow.resumed(parsed(p.to_annotation()))
        assert back.touched
        refused = podflow.step_failed(back if back.step == Step.load else _at_load_from(back),
                                      Step.load, "CheckpointChanged", "x", 120.0, retries=2,
                                      final=True)  # fmt: skip
        assert refused.outcome == "Failed" and not refused.restored
    # Still staging (the pod serves): no load can have run, a refusal restores as before.
    assert not podflow.resumed(serving_pass()).touched
    done = _at_load(serving_pass())
    done = podflow.step_failed(done, Step.load, "CheckpointChanged", "x", 1.0, retries=0)
    assert podflow.resumed(podflow.restored(done, 2.0)).touched is False  # over: unchanged
    # A record written before the field existed reads as untouched.
    doc = json.loads(serving_pass().to_annotation())
    del doc["touched"]
    assert Progress.from_annotation(json.dumps(doc)) == serving_pass()


def _at_load_from(p: Progress) -> Progress:
    for step in (Step.drain, Step.sleep, Step.wakeWeights):
        p = podflow.step_done(p, step, 1.0, 110.0)
    return p


def test_a_receive_after_a_try_that_may_have_touched_the_model_never_restores():
    p = podflow.resumed(broadcast_pass())  # a restart while the receive was running
    p = podflow.step_failed(p, Step.receive, "TransferMismatch", "x", 111.0, retries=3, final=True)
    assert p.outcome == "Failed" and not p.restored and readiness_of(p).ready is False


def _at_ready(p: Progress) -> Progress:
    for step in sequences.STEPS[: sequences.STEPS.index(Step.ready)]:
        p = podflow.step_done(p, step, 0.1, 110.0)
    return p


def test_a_pass_resumed_at_its_vouch_vouches_only_for_the_process_it_probed():
    """Found by the explorer (seed 200220 of its mixed batch): an operator that takes up a
    pass between the probe and the vouch must not vouch for whatever process the pod runs
    now. A record that names the probed process keeps it (the vouch carries it and a
    restarted container refuses); one that names none is probed again."""
    named = replace(_at_ready(serving_pass()), process="proc-1")
    back = podflow.resumed(parsed(named.to_annotation()))
    assert (back.step, back.process) == (Step.ready, "proc-1")
    unnamed = podflow.resumed(parsed(_at_ready(serving_pass()).to_annotation()))
    assert unnamed.step == Step.probe and unnamed.touched and unnamed.attempts == 0
    # A record written before records named the process reads as naming none.
    doc = json.loads(_at_ready(serving_pass()).to_annotation())
    del doc["process"]
    assert parsed(json.dumps(doc)).process == ""
