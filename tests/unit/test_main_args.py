"""`refit-operator` command-line arguments."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from refit_operator.core import history
from refit_operator.main import GC_THRESHOLDS, parse_args, process_identity, tune_gc


def test_history_limit_defaults_to_the_policy_default() -> None:
    assert parse_args([]).history_limit == history.Policy().history_limit == 10
    assert parse_args(["--history-limit=0"]).history_limit == 0
    assert parse_args(["--history-limit", "250"]).history_limit == 250


@pytest.mark.parametrize(("value", "message"), [("-1", "must be >= 0"), ("ten", "not an integer")])
def test_history_limit_refuses_bad_values(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args([f"--history-limit={value}"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_each_process_has_its_own_identity() -> None:
    """A restarted container's operator has the same pod name and pid (1) as the one before:
    its identity in the Lease, Events and claims must still differ."""
    first, second = process_identity("refit-7d9f-abcde"), process_identity("refit-7d9f-abcde")
    assert first.startswith("refit-7d9f-abcde-") and second.startswith("refit-7d9f-abcde-")
    assert first != second


@pytest.fixture
def gc_restored() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


@pytest.mark.usefixtures("gc_restored")
def test_the_operator_collects_less_often_than_the_default() -> None:
    tune_gc()
    assert gc.get_threshold() == GC_THRESHOLDS
    assert all(mine > default for mine, default in zip(GC_THRESHOLDS, (700, 10, 10), strict=True))
