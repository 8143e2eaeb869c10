"""The one RFC 3339 writer and parser (refit_operator.core.times)."""

from refit_operator.core import times


def test_epoch_reads_what_kubernetes_writes() -> None:
    assert times.epoch("1970-01-01T00:01:40Z") == 100.0
    assert times.epoch("1970-01-01T00:01:40.5Z") == 100.5
    assert times.epoch("1970-01-01T00:01:40.123456Z") == 100.123456
    assert times.epoch("1970-01-01T00:01:40") == 100.0  # no zone: UTC
    assert times.epoch("1970-01-01T01:01:40+01:00") == 100.0
    for bad in ("", None, "yesterday", 12):
        assert times.epoch(bad) is None


def test_written_timestamps_round_trip() -> None:
    assert times.rfc3339(100.7) == "1970-01-01T00:01:40Z"
    assert times.rfc3339_micro(100.5) == "1970-01-01T00:01:40.500000Z"
    assert times.epoch(times.rfc3339_micro(1_800_000_000.25)) == 1_800_000_000.25


# --- creation order ------------------------------------------------------------------------


def test_creation_stamps_are_fixed_width_so_text_order_is_time_order() -> None:
    assert times.stamp(1_800_000_000_123456789) == "2027-01-15T08:00:00.123456789Z"
    assert times.stamp(5) == "1970-01-01T00:00:00.000000005Z"
    ns = [1_800_000_000_000000000 + d for d in (9, 10, 999_999_999, 1_000_000_000)]
    assert sorted(times.stamp(n) for n in reversed(ns)) == [times.stamp(n) for n in ns]


def test_only_a_well_formed_stamp_counts() -> None:
    good = times.stamp(1_800_000_000_000000001)
    assert times.stamp_of({"annotations": {times.CREATED_ANNOTATION: good}}) == good
    for bad in ("", "2027-01-15T08:00:00.1Z", "2027-01-15T08:00:00Z", "zzz", 12, None,
                good + " ", "9999-99-99T99:99:99.999999999Z junk"):  # fmt: skip
        assert times.stamp_of({"annotations": {times.CREATED_ANNOTATION: bad}}) == "", bad
    assert times.stamp_of({}) == times.stamp_of({"annotations": None}) == ""


def test_creation_order_is_the_second_then_the_stamp_then_the_name() -> None:
    second = "2026-01-01T00:00:01Z"
    early, late = times.stamp(1_767_225_601_100000000), times.stamp(1_767_225_601_900000000)
    # refit-step-10 sorts before refit-step-9 by name; the stamps say step-9 came first.
    nine = times.order_key(times.creation_order(second, early), "refit-step-9")
    ten = times.order_key(times.creation_order(second, late), "refit-step-10")
    assert nine < ten
    # A refit of the next second is newer whatever the stamps say (a client's clock is only
    # trusted within the API server's second).
    skewed = times.creation_order(second, times.stamp(1_900_000_000_000000000))
    assert times.creation_order("2026-01-01T00:00:02Z") > skewed
    # No stamp: before every stamped refit of its second; two without: by name.
    assert times.creation_order(second) < times.creation_order(second, early)
    assert times.order_key(second, "a") < times.order_key(second, "b")
    meta = {"creationTimestamp": second, "annotations": {times.CREATED_ANNOTATION: late}}
    assert times.order_of(meta) == times.creation_order(second, late)
    assert times.order_of({"creationTimestamp": second}) == second
