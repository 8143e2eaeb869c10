"""The one RFC 3339 writer and parser (refit_operator.times)."""

from refit_operator import times


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
