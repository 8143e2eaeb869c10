"""decision.decide for a broadcast refit (spec.broadcast): status.broadcast and the
ReceiversReady condition the trainer waits for, and what a broadcast does not do (stage
ahead, converge pods that join later)."""

from __future__ import annotations

from dataclasses import replace

from refit_operator.core import podflow
from refit_operator.core.api import BroadcastRound, Condition, WeightRefitSpec, WeightRefitStatus
from refit_operator.core.decision import Decision, decide
from refit_operator.core.plan import RefitRef
from refit_operator.core.status import RECEIVERS_READY
from refit_operator.core.times import rfc3339

from tests.fixtures.refits import CREATED, NOW, STARTED, done, observe, pod, refit, spec

BROADCAST = {
    "version": "b2",
    "rendezvous": {"host": "10.0.0.5", "port": 29500},
    "manifest": {"configMapRef": {"name": "manifest"}, "digest": "a" * 64},
}
CONFIGMAP_REFERENCE = {"reference": {"source": "ConfigMap", "configMapRef": {"name": "ref"}}}


def bspec(**over: object) -> WeightRefitSpec:
    return WeightRefitSpec.model_validate(
        {"fleet": {"selector": {"matchLabels": {"app": "rollout"}}}, "broadcast": BROADCAST,
         "probe": CONFIGMAP_REFERENCE, **over}
    )  # fmt: skip


def receiving() -> podflow.Progress:
    return podflow.start("wr", "uid", "b2", "", NOW, source="broadcast")


def progressing(r: BroadcastRound | None, status: WeightRefitStatus | None = None) -> Decision:
    st = status or WeightRefitStatus(phase="Progressing", start_time=STARTED)
    pods = [pod("p0", receiving()), pod("p1", receiving())]
    return decide(replace(observe(refit(bspec(), st), pods), broadcast=r))


def receivers_ready(d: Decision) -> Condition:
    return next(c for c in d.status.conditions if c.type == RECEIVERS_READY)


def test_a_checkpoint_refit_has_no_round_and_no_receivers_condition() -> None:
    st = WeightRefitStatus(phase="Progressing", start_time=STARTED)
    prog = podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW)
    # Even a round handed in by mistake is not shown for a checkpoint refit.
    r = BroadcastRound(round=1, world_size=2, receivers=1, state="Ready")
    d = decide(replace(observe(refit(spec(), st), [pod("p0", prog)]), broadcast=r))
    assert d.status.broadcast is None
    assert RECEIVERS_READY not in {c.type for c in d.status.conditions}


def test_no_round_yet() -> None:
    d = progressing(None)
    assert d.status.broadcast is None
    c = receivers_ready(d)
    assert (c.status, c.reason) == ("False", "NoRound")
    assert c.observed_generation == 1


def test_joining_round_is_shown_and_not_ready() -> None:
    r = BroadcastRound(round=3, world_size=0, receivers=2, state="Joining")
    d = progressing(r)
    assert d.status.broadcast == r
    c = receivers_ready(d)
    assert (c.status, c.reason) == ("False", "Joining")
    assert "round 3" in c.message
    assert d.status.dump()["broadcast"] == {
        "round": 3, "worldSize": 0, "receivers": 2, "state": "Joining",
    }  # fmt: skip


def test_a_ready_or_sending_round_tells_the_trainer_where_and_how_many() -> None:
    for state in ("Ready", "Sending"):
        r = BroadcastRound(round=2, world_size=3, receivers=2, state=state)
        d = progressing(r)
        assert d.status.broadcast == r
        c = receivers_ready(d)
        assert (c.status, c.reason) == ("True", RECEIVERS_READY), state
        assert "round 2" in c.message and "ranks 1-2" in c.message
        assert "world size 3" in c.message and "10.0.0.5:29500" in c.message


def test_a_done_round_is_not_ready() -> None:
    d = progressing(BroadcastRound(round=2, world_size=3, receivers=2, state="Done"))
    c = receivers_ready(d)
    assert (c.status, c.reason) == ("False", "RoundDone")


def test_a_finished_refit_has_no_receivers_ready() -> None:
    r = BroadcastRound(round=1, world_size=2, receivers=1, state="Ready")
    prog = receiving()
    finished = [pod("p0", done(prog))]
    st = WeightRefitStatus(phase="Progressing", start_time=STARTED)
    d = decide(replace(observe(refit(bspec(), st), finished), broadcast=r))
    assert d.status.phase == "Succeeded"
    c = receivers_ready(d)
    assert (c.status, c.reason) == ("False", "RefitFinished")
    assert "Succeeded" in c.message


def test_last_transition_time_moves_only_when_the_status_flips() -> None:
    earlier = rfc3339(NOW - 60)
    old = Condition(
        type=RECEIVERS_READY, status="False", reason="Joining", message="round 1",
        last_transition_time=earlier, observed_generation=1,
    )  # fmt: skip
    st = WeightRefitStatus(phase="Progressing", start_time=STARTED, conditions=[old])
    still = progressing(BroadcastRound(round=1, receivers=2, state="Joining"), st)
    assert receivers_ready(still).last_transition_time == earlier
    flipped = progressing(BroadcastRound(round=1, world_size=3, receivers=2, state="Ready"), st)
    assert receivers_ready(flipped).last_transition_time == rfc3339(NOW)
    # One condition of the type, whatever the old status held.
    assert [c.type for c in flipped.status.conditions].count(RECEIVERS_READY) == 1


def test_a_broadcast_starts_pods_without_a_path_and_stages_nothing_ahead() -> None:
    rolling = {"type": "Rolling", "maxUnavailable": 1}
    st = WeightRefitStatus(phase="Progressing", start_time=STARTED)
    pods = [pod("p0"), pod("p1"), pod("p2")]
    d = decide(observe(refit(bspec(strategy=rolling), st), pods))
    assert [(s.pod, s.version, s.path) for s in d.start] == [("p0", "b2", "")]
    assert d.stage_ahead == []
    # The same refit from a checkpoint stages the next batch while this one is out.
    c = decide(observe(refit(spec(strategy=rolling), st), pods))
    assert c.stage_ahead == ["p1"]


def test_a_succeeded_broadcast_does_not_converge_pods_that_join_later() -> None:
    fleet = [RefitRef("wr", CREATED, "Succeeded")]
    st = WeightRefitStatus(phase="Succeeded", start_time=STARTED)
    prog = done(receiving())
    pods = [pod("p0", prog), pod("late"), pod("p1", prog, restarts=1)]
    d = decide(observe(refit(bspec(), st), pods, fleet=fleet))
    assert d.start == [] and d.status.phase == "Succeeded" and d.watching
    # A checkpoint refit in the same place brings both to its version.
    ckpt = done(podflow.start("wr", "uid", "v2", "/ckpt/v2", NOW))
    pods = [pod("p0", ckpt), pod("late"), pod("p1", ckpt, restarts=1)]
    d = decide(observe(refit(spec(), st), pods, fleet=fleet))
    assert sorted(s.pod for s in d.start) == ["late", "p1"]
