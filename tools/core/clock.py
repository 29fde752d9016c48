"""The time as the tools write it: UTC, to the second, in a record (ISO 8601) and in a folder name (sortable); to
the microsecond in a kept file's name. The one place that reads the clock as a date."""

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


__all__ = ["file_stamp", "iso", "stamp", "utc_now"]
