"""history.to_delete: which finished WeightRefits the garbage collector deletes, by policy."""

from __future__ import annotations

import pytest
from refit_operator.core import api, history, times
from refit_operator.core.history import Finished, Policy, to_delete

NOW = 1_000_000.0
FLEET = "rl/app=rollout"


def wr(
    step: int,
    phase: api.Phase = "Succeeded",
    *,
    fleet: str = FLEET,
    completed: float | None = NOW - 3600,
    ttl: int | None = None,
    name: str | None = None,
    checkpoint: bool = True,
    pods: tuple[str, ...] = (),
) -> Finished:
    """Refit of training step `step`, created `step` minutes into the run (a broadcast with
    checkpoint=False)."""
    hours, minutes = divmod(step, 60)
    return Finished(
        name=name or f"step-{step:04d}",
        created=f"2025-01-{1 + hours // 24:02d}T{hours % 24:02d}:{minutes:02d}:00Z",
        phase=phase,
        completed=completed,
        ttl=ttl,
        fleet=fleet,
        checkpoint=checkpoint,
        pods=frozenset(pods),
    )


def names(*steps: int) -> list[str]:
    return [f"step-{s:04d}" for s in steps]


# --- the count limit ---------------------------------------------------------------------------


def test_one_refit_per_step_keeps_the_newest_limit_per_fleet() -> None:
    refits = [wr(s) for s in range(1, 26)]
    assert to_delete(refits, Policy(history_limit=10), NOW) == names(*range(1, 16))
    assert to_delete(refits, Policy(), NOW) == names(*range(1, 16)), "default limit is 10"


def test_nothing_is_deleted_within_the_limit() -> None:
    refits = [wr(s) for s in range(1, 11)]
    assert to_delete(refits, Policy(history_limit=10), NOW) == []
    assert to_delete([], Policy(), NOW) == []


def test_order_is_by_creation_then_name_not_by_input_order() -> None:
    refits = [wr(s) for s in (5, 1, 4, 2, 3)]
    assert to_delete(refits, Policy(history_limit=2), NOW) == names(1, 2, 3)
    # Same creationTimestamp: the name breaks the tie (as queueing does).
    tied = [wr(7, name=n) for n in ("c", "a", "b")]
    assert to_delete(tied, Policy(history_limit=1), NOW) == ["a", "b"]


def test_every_terminal_phase_counts_and_can_be_deleted() -> None:
    phases = sorted(api.TERMINAL_PHASES - {"Succeeded"})
    refits = [wr(i + 1, phase) for i, phase in enumerate(phases)]
    refits.append(wr(len(phases) + 1))  # the target, newest
    deleted = to_delete(refits, Policy(history_limit=1), NOW)
    assert deleted == names(*range(1, len(phases) + 1))


# --- the rollback target ------------------------------------------------------------------------


def test_the_fleets_newest_succeeded_refit_survives_the_limit() -> None:
    # A run of failures after the last good step: the target is older than the newest ten.
    refits = [wr(1), wr(2), *(wr(s, "Failed") for s in range(3, 20))]
    deleted = to_delete(refits, Policy(history_limit=10), NOW)
    assert "step-0002" not in deleted, "the rollback target was deleted"
    # It takes one of the ten places: nine failures are kept with it.
    assert deleted == names(1, *range(3, 11))
    kept = {r.name for r in refits} - set(deleted)
    assert len(kept) == 10


def test_the_target_survives_its_own_ttl() -> None:
    refits = [wr(1, ttl=0), wr(2, ttl=60), wr(3, "Halted", ttl=60)]
    assert to_delete(refits, Policy(), NOW) == names(1, 3)


def test_the_target_survives_both_rules_at_once() -> None:
    refits = [wr(1), wr(2, ttl=0), *(wr(s, "RolledBack") for s in range(3, 8))]
    deleted = to_delete(refits, Policy(history_limit=1), NOW)
    assert "step-0002" not in deleted
    assert deleted == names(1, *range(3, 8))


def test_limit_zero_keeps_only_the_target() -> None:
    refits = [wr(1), wr(2), wr(3, "Failed"), wr(4, "Superseded")]
    assert to_delete(refits, Policy(history_limit=0), NOW) == names(1, 3, 4)
    # A fleet that never succeeded keeps nothing finished.
    never = [wr(1, "Failed"), wr(2, "Halted")]
    assert to_delete(never, Policy(history_limit=0), NOW) == names(1, 2)


def test_a_newer_failure_does_not_replace_the_target() -> None:
    refits = [wr(1), wr(2), wr(3, "Failed")]
    assert to_delete(refits, Policy(history_limit=1), NOW) == names(1, 3)


# --- broadcasts: the target cannot be loaded again -------------------------------------------


def test_a_broadcast_target_keeps_the_newest_checkpoint_refit_as_well() -> None:
    # Steps 1-2 loaded checkpoints, 3-4 were broadcast, 5-8 failed.
    refits = [wr(1), wr(2), wr(3, checkpoint=False), wr(4, checkpoint=False),
              *(wr(s, "Failed") for s in range(5, 9))]  # fmt: skip
    # Step 4 is the target (convergence, kubectl refit history's *); step 2 the rollback
    # target (status.previous of the next refit). Both take places of the limit.
    assert to_delete(refits, Policy(history_limit=3), NOW) == names(1, 3, 5, 6, 7)
    assert to_delete(refits, Policy(history_limit=0), NOW) == names(1, 3, 5, 6, 7, 8)
    # Neither rule deletes it: its TTL changes nothing.
    refits[1] = wr(2, ttl=0)
    assert "step-0002" not in to_delete(refits, Policy(history_limit=0), NOW)


def test_a_checkpoint_target_is_its_own_rollback_target() -> None:
    refits = [wr(1), wr(2, checkpoint=False), wr(3)]
    assert to_delete(refits, Policy(history_limit=0), NOW) == names(1, 2)
    assert to_delete(refits, Policy(history_limit=1), NOW) == names(1, 2)


def test_a_fleet_of_broadcasts_keeps_only_its_target() -> None:
    refits = [wr(s, checkpoint=False) for s in range(1, 4)]
    assert to_delete(refits, Policy(history_limit=0), NOW) == names(1, 2)
    assert history.rollback_target(refits) is None
    # A broadcast that failed is no rollback target either.
    assert history.rollback_target([*refits, wr(4, "Failed")]) is None
    assert history.rollback_target([*refits, wr(4), wr(5)]) == wr(5)


# --- the TTL ----------------------------------------------------------------------------------


def test_ttl_deletes_once_elapsed_since_completion() -> None:
    finished_at = NOW - 100
    refits = [
        wr(1, "Failed", completed=finished_at, ttl=99),  # elapsed
        wr(2, "Failed", completed=finished_at, ttl=100),  # elapsed exactly now
        wr(3, "Failed", completed=finished_at, ttl=101),  # not yet
        wr(4, "Failed", completed=finished_at, ttl=None),  # no TTL
        wr(5, completed=finished_at),  # the target
    ]
    assert to_delete(refits, Policy(history_limit=100), NOW) == names(1, 2)
    assert to_delete(refits, Policy(history_limit=100), NOW + 1) == names(1, 2, 3)


def test_ttl_zero_deletes_as_soon_as_finished() -> None:
    refits = [wr(1), wr(2, "Superseded", completed=NOW, ttl=0)]
    assert to_delete(refits, Policy(), NOW) == names(2)


def test_ttl_needs_a_known_completion_time() -> None:
    refits = [wr(1), wr(2, "Failed", completed=None, ttl=0)]
    assert to_delete(refits, Policy(), NOW) == []


def test_ttl_and_limit_together() -> None:
    # Old refits fall to the limit; a kept one with an elapsed TTL goes too.
    refits = [*(wr(s) for s in range(1, 6)), wr(6, "Failed", ttl=10), wr(7)]
    assert to_delete(refits, Policy(history_limit=3), NOW) == names(1, 2, 3, 4, 6)


# --- what is never touched ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "phase",
    sorted(set(api.Phase.__args__) - api.TERMINAL_PHASES),  # type: ignore[attr-defined]
)
def test_active_refits_are_never_deleted(phase: api.Phase) -> None:
    refits = [
        wr(1, phase, completed=None, ttl=0),
        wr(2, phase, completed=NOW - 10_000, ttl=0),  # a stale completionTime changes nothing
        wr(3, "Failed"),
    ]
    assert to_delete(refits, Policy(history_limit=0), NOW) == names(3)


def test_active_refits_do_not_take_places_in_the_limit() -> None:
    refits = [wr(1), wr(2), wr(3, "Progressing"), wr(4, "Queued"), wr(5, "Pending")]
    assert to_delete(refits, Policy(history_limit=2), NOW) == []
    assert to_delete(refits, Policy(history_limit=1), NOW) == names(1)


def test_fleets_are_counted_and_protected_separately() -> None:
    other = "rl/app=eval"
    refits = [
        *(wr(s) for s in range(1, 6)),
        wr(1, fleet=other, name="eval-1"),
        wr(2, "Failed", fleet=other, name="eval-2"),
        wr(3, "Failed", fleet=other, name="eval-3"),
        wr(4, "Progressing", fleet=other, name="eval-4"),
    ]
    deleted = to_delete(refits, Policy(history_limit=2), NOW)
    # FLEET keeps steps 4 and 5; the other fleet keeps its target eval-1 and eval-3.
    assert deleted == ["step-0001", "eval-2", "step-0002", "step-0003"]
    assert to_delete(refits, Policy(history_limit=5), NOW) == []


def test_same_names_in_two_fleets_are_separate_refits() -> None:
    a = [wr(s, fleet="ns-a/app=x", name=f"ns-a/step-{s}") for s in range(1, 4)]
    b = [wr(s, fleet="ns-b/app=x", name=f"ns-b/step-{s}") for s in range(1, 3)]
    assert to_delete([*a, *b], Policy(history_limit=2), NOW) == ["ns-a/step-1"]


# --- the policy and the inputs -----------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, -10])
def test_negative_limit_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match=r"history_limit must be >= 0"):
        Policy(history_limit=bad)


@pytest.mark.parametrize("bad", [1.5, "10", True, None])
def test_non_integer_limit_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="history_limit must be an integer"):
        Policy(history_limit=bad)  # type: ignore[arg-type]


def test_default_policy() -> None:
    assert Policy().history_limit == history.DEFAULT_HISTORY_LIMIT == 10


def test_from_object_reads_a_weightrefit_as_the_api_server_returns_it() -> None:
    obj = {
        "metadata": {"name": "step-7", "creationTimestamp": "2025-01-01T00:07:00Z"},
        "spec": {"ttlSecondsAfterFinished": 600},
        "status": {"phase": "Failed", "completionTime": "2025-01-01T00:08:00Z"},
    }
    r = Finished.from_object(obj, FLEET)
    assert r == Finished("step-7", "2025-01-01T00:07:00Z", "Failed", 1735690080.0, 600, FLEET)
    fresh = Finished.from_object({"metadata": {"name": "new"}, "spec": {}}, FLEET)
    assert (fresh.phase, fresh.completed, fresh.ttl) == ("Pending", None, None)
    odd = {"metadata": {"name": "x"}, "status": {"completionTime": "yesterday"}}
    assert Finished.from_object(odd, FLEET).completed is None
    assert r.checkpoint
    broadcast = {"metadata": {"name": "b"}, "spec": {"broadcast": {"version": "b"}}}
    assert not Finished.from_object(broadcast, FLEET).checkpoint


def test_refits_of_one_second_are_kept_by_their_creation_stamps_not_their_names() -> None:
    second = "2025-01-01T00:07:00Z"

    def obj(name: str, ns: int) -> dict:
        meta = {"name": name, "creationTimestamp": second,
                "annotations": {times.CREATED_ANNOTATION: times.stamp(ns)}}  # fmt: skip
        return {"metadata": meta, "spec": {}, "status": {"phase": "Succeeded"}}

    ns = 1_735_690_020_000000000
    refits = [Finished.from_object(obj("refit-step-9", ns + 1), FLEET),
              Finished.from_object(obj("refit-step-10", ns + 2), FLEET)]  # fmt: skip
    assert history.target(refits) == refits[1]
    assert to_delete(refits, Policy(history_limit=1), NOW) == ["refit-step-9"]


def test_cost_stays_flat_for_a_long_run() -> None:
    """Applied after every step, the collector keeps a long run at limit + active refits."""
    policy = Policy(history_limit=10)
    alive: list[Finished] = []
    for step in range(1, 2001):
        alive.append(wr(step, "Failed" if step % 7 == 0 else "Succeeded"))
        alive.append(wr(step + 1, "Progressing"))  # the next step's refit, already applied
        doomed = set(to_delete(alive, policy, NOW))
        alive = [r for r in alive if r.name not in doomed and r.phase != "Progressing"]
        assert len(alive) <= 10
    assert [r.name for r in alive] == names(*range(1991, 2001))


# --- fleets are the pods refits share, not their selector text ------------------------------

POD_FLEET = ("pod-0", "pod-1")


def test_a_selector_that_varies_from_step_to_step_keeps_a_bounded_history() -> None:
    """One refit per step over the same pods, each with its own selector text (an extra
    matchExpression, another label of the same pods): one fleet, so the run stays at the
    limit instead of keeping one target per text."""
    policy = Policy(history_limit=3)
    alive: list[Finished] = []
    for step in range(1, 501):
        phase: api.Phase = "Failed" if step % 5 == 0 else "Succeeded"
        alive.append(wr(step, phase, fleet=f"rl/app=rollout,step notin (x{step})", pods=POD_FLEET))
        doomed = set(to_delete(alive, policy, NOW))
        alive = [r for r in alive if r.name not in doomed]
        assert len(alive) <= 3
    assert [r.name for r in alive] == names(498, 499, 500)
    # The target (499: 500 failed) is kept, whatever text a newer refit has.
    alive.append(wr(501, "Failed", fleet="rl/other-text", pods=POD_FLEET))
    assert to_delete(alive, Policy(history_limit=0), NOW) == names(498, 500, 501)


def test_each_pods_target_is_kept_when_selectors_overlap_in_part() -> None:
    # a: pod-0 and pod-1; b (newer): pod-1 only. pod-0's target is still a.
    a = wr(1, fleet="rl/app=rollout", pods=("pod-0", "pod-1"))
    b = wr(2, fleet="rl/tier=gen", pods=("pod-1",))
    older = wr(0, fleet="rl/zone=z", pods=("pod-0",))  # pod-0's old target
    assert to_delete([older, a, b], Policy(history_limit=0), NOW) == names(0)
    # Chained through pod-1, a, b and c are one fleet: the limit counts them together.
    c = wr(3, "Failed", fleet="rl/zone=y", pods=("pod-1", "pod-2"))
    d = wr(4, "Failed", fleet="rl/zone=x", pods=("pod-2",))
    assert to_delete([older, a, b, c, d], Policy(history_limit=3), NOW) == names(0, 3)


def test_a_broadcast_target_of_a_pod_keeps_that_pods_checkpoint_behind_it() -> None:
    ckpt = wr(1, fleet="rl/app=rollout", pods=POD_FLEET)
    older = wr(0, fleet="rl/app=rollout", pods=POD_FLEET)
    bcast = wr(2, fleet="rl/tier=gen", pods=POD_FLEET, checkpoint=False)
    assert to_delete([older, ckpt, bcast], Policy(history_limit=0), NOW) == names(0)


def test_a_selector_that_selects_no_pod_keeps_its_own_target() -> None:
    """A fleet scaled to zero: its target is what its pods converge to when they return."""
    gone = [wr(s, fleet="rl/app=scaled-to-zero") for s in (1, 2, 3)]
    live = [wr(s, fleet="rl/app=rollout", pods=POD_FLEET) for s in (4, 5)]
    assert to_delete([*gone, *live], Policy(history_limit=1), NOW) == names(1, 2, 4)


def test_the_spec_carries_the_ttl() -> None:
    base = {
        "fleet": {"selector": {"matchLabels": {"app": "x"}}},
        "checkpoint": {"path": "/c", "version": "v"},
    }
    assert api.WeightRefitSpec.model_validate(base).ttl_seconds_after_finished is None
    assert "ttlSecondsAfterFinished" not in api.WeightRefitSpec.model_validate(base).dump()
    spec = api.WeightRefitSpec.model_validate({**base, "ttlSecondsAfterFinished": 600})
    assert spec.ttl_seconds_after_finished == 600
    assert spec.dump()["ttlSecondsAfterFinished"] == 600
