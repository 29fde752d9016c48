"""The time as the tools write it: UTC, to the second, in a record (ISO 8601) and in a folder name (sortable); to
the minute in a measurement's heading; to the microsecond in a file name that must not collide. The one place
that reads the clock as a date."""

from __future__ import annotations

from datetime import datetime, timezone


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def iso(when: datetime | None = None) -> str:
    """`2026-12-05T13:31:11+00:00`: a record's time (started, finished, fetched)."""
    return (when or utc_now()).isoformat(timespec="seconds")


def file_stamp(when: datetime | None = None) -> str:
    """`20261205T133111.123456Z`: the time in a kept file's name, to the microsecond (two within a second differ)."""
    return (when or utc_now()).strftime("%Y%m%dT%H%M%S.%fZ")


def stamp(when: datetime | None = None) -> str:
    """`20261205-133111`: the time in a run folder's name, which sorts by it."""
    return (when or utc_now()).strftime("%Y%m%d-%H%M%S")


def fine_stamp(when: datetime | None = None) -> str:
    """`20261205T133111123456`: the time in a file's name where two in the same second must differ."""
    return (when or utc_now()).strftime("%Y%m%dT%H%M%S%f")


def minute(when: datetime | None = None) -> str:
    """`2026-12-05 13:31 UTC`: when a measurement was taken, in its record's heading."""
    return (when or utc_now()).strftime("%Y-%m-%d %H:%M UTC")


__all__ = ["file_stamp", "fine_stamp", "iso", "minute", "stamp", "utc_now"]
