"""The clock's formats: every time the tools write goes through tools.core.clock, each format as it was written."""

from __future__ import annotations

from datetime import datetime, timezone

from tools.core import clock

WHEN = datetime(2026, 12, 5, 13, 31, 11, 123456, tzinfo=timezone.utc)


def test_each_format_as_records_folders_and_headings_write_it():
    assert clock.iso(WHEN) == "2026-12-05T13:31:11+00:00"
    assert clock.stamp(WHEN) == "20261205-133111"
    assert clock.fine_stamp(WHEN) == "20261205T133111123456"
    assert clock.minute(WHEN) == "2026-12-05 13:31 UTC"


def test_without_a_time_each_reads_the_utc_clock_now():
    before = datetime.now(timezone.utc).replace(microsecond=0)
    assert datetime.fromisoformat(clock.iso()) >= before
    assert clock.utc_now().tzinfo is timezone.utc
    assert len(clock.fine_stamp()) == len("20261205T133111123456") and clock.minute().endswith(" UTC")
