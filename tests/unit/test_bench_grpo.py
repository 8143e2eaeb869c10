"""The grpo bench suite's pure part: a trainer document's records -> each step's turnaround
and its split, and the rows (the suite itself runs real servers: `python -m bench`)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.grpo import (
    Turnaround,
    async_metrics,
    grpo_metrics,
    keep_refit_throughput,
    turnarounds,
)


def record(step: int, began: float, publish: float, operator: float, first: float | None,
           generation: float = 0.0) -> dict[str, Any]:  # fmt: skip
    """A StepRecord as testbed/grpo_trainer.py writes it (asdict), the fields used."""
    return {"step": step, "publish_began_at": began, "publish_seconds": publish,
            "operator_seconds": operator, "first_request_at": first,
            "generation_seconds": generation}  # fmt: skip


def run() -> dict[str, Any]:
    """Two steps: 0 (start-up, no optimizer step), 1 (a full one) and the final publish (2,
    from on_train_end: no rollouts). Times on the trainer's monotonic clock."""
    return {
        "steps": {"0": {"reward": 0.0}, "1": {"optimizer_end_at": 100.0},
                  "2": {"optimizer_end_at": 200.0}},
        "records": [
            record(0, 10.0, 0.5, 4.0, 14.6, generation=1.0),
            record(1, 100.25, 0.5, 3.0, 103.85, generation=2.0),
            record(2, 200.25, 0.5, 3.0, None),
        ],
    }  # fmt: skip


def test_a_step_is_split_from_the_optimizer_end_to_the_first_request() -> None:
    (t,) = turnarounds(run())
    assert t.step == 1
    assert t.trainer_seconds == pytest.approx(0.25)  # optimizer end -> rollout function
    assert (t.publish_seconds, t.operator_seconds) == (0.5, 3.0)
    assert t.rest_seconds == pytest.approx(0.1)  # Succeeded -> the first request
    assert t.total_seconds == pytest.approx(3.85)
    assert t.refit_seconds == pytest.approx(3.5)
    assert t.generation_seconds == 2.0


def test_the_start_up_and_the_final_publish_are_not_steps() -> None:
    assert [t.step for t in turnarounds(run())] == [1]


def test_the_rows_and_the_ratio_to_the_direct_refits_median() -> None:
    steps = [Turnaround(1, 0.2, 0.5, 3.5, 0.1, 2.0), Turnaround(2, 0.2, 0.5, 1.5, 0.1, 2.0)]
    rows = {m.name: m for m in grpo_metrics(steps, run()["records"][0], [1.0, 2.0, 3.0])}
    total = rows["turnaround: optimizer step end -> first rollout request at the new version"]
    assert total.samples == pytest.approx([4.3, 2.3])
    assert rows["start-up publish + operator (step 0)"].samples == [4.5]
    ratio = rows["operator-driven refit (publish + operator) / direct refit"]
    assert ratio.samples == pytest.approx([2.0, 1.0])  # (0.5 + 3.5) / 2, (0.5 + 1.5) / 2
    assert all(m.unit in ("s", "x") for m in rows.values())


def test_a_run_without_a_full_step_has_no_rows() -> None:
    with pytest.raises(ValueError, match="no step"):
        grpo_metrics([], {}, [1.0])


def async_run() -> dict[str, Any]:
    """An async_grpo_trainer document, the fields used: three syncs (the cold one, then two
    refits the worker ran through: 10-12 and 14-15), completions (when, unit, served, tokens),
    and TRL's log time of each step."""
    return {
        "syncs": [{"began": 0.0, "ended": 5.0}, {"began": 10.0, "ended": 12.0},
                  {"began": 14.0, "ended": 15.0}],
        "finished": [[9.0, "a", ["v1"], 100],  # before the first refit the worker ran through
                     [11.0, "a", ["v1", "v2"], 12], [11.5, "b", ["v1"], 8],  # during 10-12
                     [13.0, "b", ["v2"], 6],  # between
                     [14.5, "a", ["v2"], 3]],  # during 14-15
        "steps": {"1": {"at": 12.5}, "2": {"at": 15.5}},
        "steady": {"began": 20.0, "ended": 22.5,  # two whole seconds: 20-21, 21-22
                   "finished": [[20.5, "a", ["v3"], 4], [21.2, "b", ["v3"], 2],
                                [22.2, "a", ["v3"], 50]]},
    }  # fmt: skip


def test_throughput_during_each_refit_and_between_them() -> None:
    during, between = keep_refit_throughput(async_run()["syncs"], async_run()["finished"])
    assert during == pytest.approx([10.0, 3.0])  # 20 tokens in 2 s, 3 in 1 s
    assert between == pytest.approx([3.0])  # 6 tokens in 12-14


def test_the_async_rows_compare_both_integrations_per_step() -> None:
    rows = {m.name: m for m in async_metrics(run(), async_run())}
    assert rows["async: fleet completion tokens/s in steady state"].samples == [4.0, 2.0]
    ratio = rows["async: throughput during a Rolling keep refit / steady state"]
    assert ratio.samples == pytest.approx([10 / 3, 1.0])  # over the steady mean, 3
    assert rows["wall per optimizer step: sync (GRPOTrainer, AllAtOnce)"].samples == [100.0]
    assert rows["wall per optimizer step: async (AsyncGRPOTrainer, Rolling keep)"].samples == [3.0]
    assert rows["refit per step: sync (publish + operator)"].samples == [3.5, 3.5]
    refit = rows["refit per step: async (reference + broadcast + refit, Rolling keep)"]
    assert refit.samples == [2.0, 1.0]


def test_too_few_syncs_have_no_throughput_rows() -> None:
    with pytest.raises(ValueError, match="too few syncs"):
        keep_refit_throughput(async_run()["syncs"][:2], async_run()["finished"])
