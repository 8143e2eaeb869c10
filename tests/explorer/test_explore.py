"""The deterministic fault explorer (testbed/explorer) over the operator's real Engine.

CI runs every fault class whose invariants hold on the current code: a few hundred full
schedules (40 steps, 3 pods) and a couple of thousand short ones (20 steps, 2 pods, classes
mixed by seed). testbed/explorer/holes.py's KNOWN_HOLES lists what the explorer still finds,
each with a seed that shows it: a class switched off, or a violation tolerated by its
signature. Issue 41's classes (holes.FEATURES: LoRA adapters beside the base weights, pod
groups) run in tests of their own, alone and with the holding classes, tolerating their known
holes by signature. REFIT_EXPLORER_SCHEDULES scales the number of schedules (``make bench`` runs the
long mode: ``python -m bench --only explorer``)."""

from __future__ import annotations

import os

import pytest
from refit_operator.core import probe

from testbed.explorer import Config, run_schedule
from testbed.explorer.explore import ADAPTER_CLASSES
from testbed.explorer.holes import (
    FEATURES,
    HOLDING,
    ISSUE_41,
    KNOWN_HOLES,
    REGRESSIONS,
    SOURCES,
    known,
    run_batch,
)
from testbed.simworker.transfer import TransferRoutes

SCALE = int(os.environ.get("REFIT_EXPLORER_SCHEDULES", "1"))


def _run(seeds: range, classes: frozenset[str]) -> int:
    checks = 0
    for seed in seeds:
        result = run_schedule(Config(seed, classes))
        unknown = [v for v in result.violations if known(v) is None]
        assert not unknown, result.report()
        checks += result.checks
    return checks


def test_same_seed_same_trace_byte_for_byte() -> None:
    config = Config(7, frozenset(HOLDING))
    a, b = run_schedule(config), run_schedule(config)
    assert a.trace == b.trace and len(a.trace) > 50
    assert run_schedule(Config(8, frozenset(HOLDING))).trace != a.trace


def test_fault_free_schedules_converge() -> None:
    assert _run(range(20 * SCALE), frozenset()) > 0


@pytest.mark.parametrize("fault", HOLDING)
def test_each_class_alone_keeps_the_invariants(fault: str) -> None:
    _run(range(1000, 1000 + 8 * SCALE), frozenset({fault}))


def test_every_holding_class_at_once_keeps_the_invariants() -> None:
    _run(range(2000, 2000 + 100 * SCALE), frozenset(HOLDING))


@pytest.mark.parametrize("fault", FEATURES)
def test_each_feature_class_alone_keeps_the_invariants_but_its_known_holes(fault: str) -> None:
    _run(range(3000, 3000 + 8 * SCALE), frozenset({fault}))


def test_feature_classes_with_the_holding_ones_keep_the_invariants_but_known_holes() -> None:
    """Adapters among every holding class, pod groups among them, and every feature class
    at once (a pod group's hole ends most of those early)."""
    adapters = frozenset(ADAPTER_CLASSES) | frozenset(HOLDING)
    assert _run(range(4000, 4000 + 30 * SCALE), adapters) > 0
    assert _run(range(4000, 4000 + 30 * SCALE), frozenset({"pod_groups", *HOLDING})) > 0
    assert _run(range(4000, 4000 + 20 * SCALE), frozenset(FEATURES)) > 0


def test_many_short_schedules_keep_the_invariants() -> None:
    """800 short schedules (about 40 s of CPU; the bench's long mode runs many more): a
    failure prints its seed, its trace and the command that replays it."""
    batch = run_batch(range(10_000, 10_000 + 800 * SCALE))
    print(batch.summary())
    assert not batch.failures, (
        f"{len(batch.failures)} schedules failed (seeds "
        f"{[r.config.seed for r in batch.failures]}); the first:\n{batch.failures[0].report()}"
    )


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_the_schedules_that_found_fixed_holes_hold(name: str) -> None:
    """Each seed runs without a violation, except a known hole's own (creation_order's
    signature): a schedule mixing operator restarts and refits created in one second can
    meet it once the operator's calls shift its interleaving (seed 200442 does since every
    preflight reads /get_world_size); test_known_holes_are_still_found tracks that hole."""
    classes, seeds = REGRESSIONS[name]
    for seed in seeds:
        result = run_schedule(Config(seed, classes))
        unknown = [v for v in result.violations if known(v) is None]
        assert not unknown, result.report()


@pytest.mark.parametrize("name", sorted(ISSUE_41))
def test_the_schedules_that_found_issue_41_hold(name: str) -> None:
    """Each of issue 41's breaks of one traffic gate per pod, found on main before the fix,
    replayed exactly (its steps, fleet, invariants ignored): nothing but a known hole."""
    for config in ISSUE_41[name]:
        result = run_schedule(config)
        unknown = [v for v in result.violations if known(v) is None]
        assert not unknown, result.report()


@pytest.mark.parametrize("name", sorted(KNOWN_HOLES))
def test_known_holes_are_still_found(name: str) -> None:
    """The explorer finds each known hole from its seed (when a fix merges, this fails: drop
    the hole so that CI holds the fix)."""
    hole = KNOWN_HOLES[name]
    result = run_schedule(hole.config())
    assert not result.ok, f"{name} seed {hole.seed} no longer fails: drop the hole"
    if hole.signature:
        assert any(hole.matches(v) for v in result.violations), result.report()


def test_a_lease_created_anew_leaves_the_old_holders_passes_alone() -> None:
    """Seed 10681 (short, in CI's batch too): the Lease is deleted under a live leader and a
    standby of the same installation creates it at once; it took the old leader's pod a
    second later, and the old pass's vouch reached the pod beside the new pass's token. A
    Lease this process created leaves another holder's claims alone for a lease duration
    (leader.Lease.created_at): that holder's own deadline has passed by then."""
    classes = frozenset({"history_gc", "lease_delete", "worker_timeout"})
    result = run_schedule(Config(10681, classes, steps=20, pods=2))
    assert result.ok, result.report()


def test_a_stale_drafter_is_kept_out_and_the_explorer_sees_one_let_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """drafter_stale (holes.SOURCES: out of CI's mixes, so their seeds keep their schedules;
    the bench's long mode runs it among the holding classes): the pods run a drafter refitted
    from each checkpoint's drafter/; some refits carry one trained with another target, or
    none, and some loads leave the drafter as it was.
    Two seeds alone and two among the holding classes keep the invariants; with the
    drafter's judgement switched off (the probe scores only the target), the same seed finds
    a pod in traffic beside the stale drafter."""
    assert "drafter_stale" in SOURCES and not set(SOURCES) & set(HOLDING)
    drafters = frozenset({"drafter_stale"})
    _run(range(5000, 5002), drafters)
    _run(range(5000, 5002), drafters | frozenset(HOLDING))
    monkeypatch.setattr(probe, "judge_drafter", lambda outcome, *_: outcome)
    result = run_schedule(Config(0, drafters))
    assert any(
        v.invariant == "ready-probed" and "beside a stale drafter" in v.message
        for v in result.violations
    ), result.report()


def test_broadcast_rounds_keep_the_invariants_whatever_the_trainer_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """broadcast_rounds (holes.SOURCES, out of CI's mixes): broadcast refits whose simulated
    trainer (testbed/explorer/trainer.py) is on time, late, dies mid-send, or sends bytes
    other than it promised, received by the pods through the operator's own receive
    (controller/sources/broadcast.py, rounds.py). Four seeds alone and four among the holding
    classes keep every invariant (a failed or mismatched receive never in traffic on what it
    did not probe, a Succeeded refit's units serving its version, the gate the pure one);
    between them the trainer does each of its four things. With an engine that loads each
    tensor as it arrives (vLLM's built-in NCCL engine), a round refused at its end has touched
    the model, and the operator, which takes TransferMismatch for untouched, puts the pod back
    in traffic on bytes nobody probed: the same seed finds it."""
    assert "broadcast_rounds" in SOURCES
    broadcast = frozenset({"broadcast_rounds"})
    traces = []
    for seed in range(6004, 6008):
        for classes in (broadcast, broadcast | frozenset(HOLDING)):
            result = run_schedule(Config(seed, classes))
            assert not [v for v in result.violations if known(v) is None], result.report()
            traces += result.trace
    seen = "\n".join(traces)
    for what in ("trainer ontime", "trainer late by", "died mid-send", "trainer wrong"):
        assert what in seen, what
    monkeypatch.setattr(TransferRoutes, "loads_as_it_receives", True)
    result = run_schedule(Config(6000, broadcast))
    assert any(
        v.invariant == "ready-probed" and "~changed" in v.message for v in result.violations
    ), result.report()
