"""refit_worker.fence: parsing the fencing header and the admit/refuse rule (pure)."""

from __future__ import annotations

import pytest
from refit_worker import contract, fence
from refit_worker.fence import FenceError, FenceTracker, format_fence, parse_fence, read_fence


def test_contract_names() -> None:
    assert contract.FENCE_HEADER == "X-Refit-Fence"
    assert contract.STALE_FENCE == "StaleFence"
    # A fencing refusal is the guard's, not a worker extension RPC's rejection code.
    assert contract.STALE_FENCE not in contract.REJECTION_CODES


@pytest.mark.parametrize(
    ("value", "token"),
    [
        ("0", 0),
        ("7", 7),
        (b"42", 42),
        (" 12\t", 12),  # optional whitespace around a header value
        ("007", 7),
        (str((3 << 32) | 5), (3 << 32) | 5),  # the operator's (leaseTransitions << 32) | pass
        (str(2**64 - 1), 2**64 - 1),
    ],
)
def test_parse_accepts_plain_decimal_integers(value: str | bytes, token: int) -> None:
    assert parse_fence(value) == token


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("", "is empty"),
        ("   ", "is empty"),
        ("abc", "'abc' is not a non-negative integer"),
        ("1.5", "is not a non-negative integer"),
        ("0x10", "is not a non-negative integer"),
        ("+5", "is not a non-negative integer"),
        ("1_000", "is not a non-negative integer"),
        ("1 2", "is not a non-negative integer"),
        ("١٢", "is not a non-negative integer"),  # Arabic-Indic digits: int() takes them
        (b"\xff1", "is not a non-negative integer"),
        ("-", "is not a non-negative integer"),
        ("-1", "'-1' is negative"),
        ("-0", "is negative"),
        ("1" * 21, "is 21 characters long; a fencing token has at most 20 digits"),
        ("9" * 5000, "is 5000 characters long"),
        (str(2**64), "is above the largest fencing token 18446744073709551615"),
    ],
)
def test_parse_refuses_malformed_values_clearly(value: str | bytes, says: str) -> None:
    with pytest.raises(FenceError, match="X-Refit-Fence header") as err:
        parse_fence(value)
    assert says in str(err.value)
    assert len(str(err.value)) < 200  # a long value is not echoed in full
    assert isinstance(err.value, ValueError)


def test_read_fence_from_all_header_values() -> None:
    assert read_fence([]) is None
    assert read_fence(["5"]) == 5
    assert read_fence([b"5"]) == 5
    with pytest.raises(FenceError, match="given 2 times"):
        read_fence(["5", "5"])
    with pytest.raises(FenceError, match="not a non-negative integer"):
        read_fence(["x"])


def test_format_fence_is_the_inverse_and_checks_the_range() -> None:
    for token in (0, 1, (7 << 32) | 9, fence.MAX_FENCE):
        assert parse_fence(format_fence(token)) == token
    for bad in (-1, fence.MAX_FENCE + 1):
        with pytest.raises(FenceError, match="outside"):
            format_fence(bad)
    for wrong in (True, 1.0, "1"):
        with pytest.raises(FenceError, match="integer"):
            format_fence(wrong)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("method", "fenced"),
    [
        *[(m, True) for m in ("POST", "post", "PUT", "DELETE", "PATCH")],
        *[(m, False) for m in ("GET", "HEAD", "OPTIONS", "get")],
    ],
)
def test_only_state_changing_methods_are_fenced(method: str, fenced: bool) -> None:
    assert fence.is_fenced(method) is fenced


def test_tracker_admits_equal_and_higher_and_refuses_lower() -> None:
    t = FenceTracker()
    assert t.highest is None
    assert t.admit(5)
    assert t.highest == 5
    assert t.admit(5)  # the same pass, its next call
    assert t.highest == 5
    assert not t.admit(4)  # an older pass
    assert t.highest == 5  # a refusal leaves the mark alone
    assert not t.admit(0)
    assert t.admit(9)  # a newer pass takes over
    assert t.highest == 9
    assert not t.admit(5)  # ... and the one before it is now stale
    assert t.highest == 9


def test_tracker_admits_calls_without_a_token_and_keeps_the_mark() -> None:
    t = FenceTracker()
    assert t.admit(None)
    assert t.highest is None
    assert t.admit(3)
    assert t.admit(None)  # a person with the admin token and curl
    assert t.highest == 3
    assert not t.admit(2)


def test_tracker_starts_at_zero_too() -> None:
    t = FenceTracker()
    assert t.admit(0)
    assert t.highest == 0
    assert t.admit(0)


def test_tracker_reset_forgets_the_mark() -> None:
    t = FenceTracker()
    assert t.admit(10)
    t.reset()
    assert t.highest is None
    assert t.admit(1)  # a restarted pod admits any token
    assert t.highest == 1


def test_trackers_are_independent() -> None:
    a, b = FenceTracker(), FenceTracker()
    assert a.admit(10)
    assert b.admit(1)
    assert (a.highest, b.highest) == (10, 1)


def test_bodies() -> None:
    message = (
        "fencing token 3 is older than 8, the newest this pod has seen: "
        "another refit pass owns this pod"
    )
    assert fence.stale_fence_message(3, 8) == message
    assert fence.stale_fence_body(3, 8) == {"error": {"code": "StaleFence", "message": message}}
    body = fence.malformed_fence_body("bad")
    assert body["error"]["message"] == "bad"
    assert body["error"]["code"] == 400
    assert (fence.STALE_FENCE_STATUS, fence.MALFORMED_FENCE_STATUS) == (409, 400)
