import pytest
from refit_operator import podflow
from refit_operator.podflow import STEPS, Finished, Progress, RunStep, WaitUntil


def fresh() -> Progress:
    return podflow.start("wr", "uid-1", "v2", "/ckpt/v2", now=100.0, restarts=3)


def test_steps_in_the_documented_order():
    assert STEPS == (
        "drain", "sleep", "wakeWeights", "preflight", "load", "wakeKV", "resetCache",
        "stampVersion", "probe", "ready",
    )  # fmt: skip


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
        podflow.step_done(fresh(), "load", 1.0, 1.0)


def test_retries_back_off_then_fail_closed():
    p = fresh()
    p = podflow.step_failed(p, "drain", "HttpError", "500", now=200.0, retries=2)
    assert p.outcome == "" and p.not_before == 201.0
    assert podflow.next_action(p, 200.5) == WaitUntil(201.0)
    assert podflow.next_action(p, 201.0) == RunStep("drain")
    p = podflow.step_failed(p, "drain", "HttpError", "500", now=201.0, retries=2)
    assert p.not_before == 203.0
    p = podflow.step_failed(p, "drain", "HttpError", "500", now=203.0, retries=2)
    assert p.outcome == "Failed" and p.reason == "HttpError" and p.attempts == 3


def test_worker_rejection_is_final_at_once():
    p = podflow.step_failed(fresh(), "drain", "ManifestMismatch", "sha", now=1.0, retries=5)
    assert p.outcome == "Failed"


def test_probe_verdicts():
    p = fresh()
    passed = podflow.probe_judged(p, "Pass", "ProbePassed", "", {"verdict": "Pass"}, 5.0)
    assert passed.outcome == "" and passed.probe == {"verdict": "Pass"}
    inc = podflow.probe_judged(p, "Inconclusive", "ProbeNaN", "nan", {}, 5.0)
    assert inc.outcome == "Inconclusive" and inc.reason == "ProbeNaN"
    assert podflow.probe_judged(p, "Fail", "NllDrift", "", {}, 5.0).outcome == "Failed"


def test_annotation_round_trip_and_garbage():
    p = podflow.step_done(fresh(), "drain", 0.1, 1.0)
    assert Progress.from_annotation(p.to_annotation()) == p
    assert Progress.from_annotation("{not json") is None
    assert Progress.from_annotation('{"unknown": 1}') is None
    assert Progress.from_annotation(None) is None


def test_load_read_back_guard():
    assert podflow.load_needed("v1", "v2")
    assert not podflow.load_needed("v2", "v2")


def test_backoff_is_bounded():
    assert podflow.backoff(1) == 1.0
    assert podflow.backoff(50) == podflow.BACKOFF_MAX_SECONDS


def test_sleep_level_zero_skips_sleep_and_wakes():
    skipped = [s for s in STEPS if not podflow.step_applies(s, 0)]
    assert skipped == ["sleep", "wakeWeights", "wakeKV"]
    assert all(podflow.step_applies(s, 1) for s in STEPS)


def test_progress_is_recorded_at_checkpoints_only():
    p = fresh()
    recorded = []
    for step in STEPS:
        after = podflow.step_done(p, step, 0.1, 1.0)
        if podflow.must_record(p, after):
            recorded.append(step)
        p = after
    # Start is recorded by the caller; then once the weights are loaded, and at the end.
    assert recorded == ["load", "ready"]


def test_failed_tries_and_verdicts_are_recorded():
    p = podflow.step_done(fresh(), "drain", 0.1, 1.0)
    retry = podflow.step_failed(p, "sleep", "SleepTimeout", "slow", now=2.0, retries=3)
    assert retry.outcome == "" and podflow.must_record(p, retry)
    failed = podflow.probe_judged(p, "Fail", "NllDrift", "drift", {}, 3.0)
    assert podflow.must_record(p, failed)


def test_read_back_before_load_only_when_a_load_may_have_run():
    at_load = fresh()
    assert not podflow.must_read_back(at_load, resumed=False)
    assert podflow.must_read_back(at_load, resumed=True)
    retried = podflow.step_failed(at_load, "load", "LoadTimeout", "slow", now=2.0, retries=3)
    assert podflow.must_read_back(retried, resumed=False)


def test_readiness_follows_the_pass():
    p = fresh()
    assert podflow.readiness(p) == podflow.Readiness(False, "Refitting", "refit to v2 in progress")
    for step in STEPS[:-1]:
        p = podflow.step_done(p, step, 0.1, 1.0)
        assert not podflow.readiness(p).ready
    done = podflow.step_done(p, "ready", 0.1, 1.0)
    assert podflow.readiness(done) == podflow.Readiness(True, "ProbePassed", "weights v2 probed")
    failed = podflow.probe_judged(p, "Fail", "NllDrift", "nll 9.1 vs 2.0", {}, 3.0)
    assert podflow.readiness(failed) == podflow.Readiness(
        False, "NllDrift", "NllDrift: nll 9.1 vs 2.0"
    )


def test_claim_round_trips_and_unreadable_is_none():
    c = podflow.Claim(refit="wr", uid="u", fence=(3 << 32) | 5, holder="op0-1")
    assert podflow.Claim.from_annotation(c.to_annotation()) == c
    for bad in (
        None,
        "",
        "{",
        '{"refit": "wr"}',
        '{"refit":"a","uid":"u","fence":"x","holder":"h"}',
    ):
        assert podflow.Claim.from_annotation(bad) is None


def test_newer_than_breaks_timestamp_ties_by_name():
    p = podflow.start("b", "u", "v", "/p", 0.0, created="2026-01-01T00:00:00Z")
    assert p.newer_than("2026-01-01T00:00:00Z", "a")
    assert not p.newer_than("2026-01-01T00:00:00Z", "c")
    assert not p.newer_than("2026-01-02T00:00:00Z", "a")
