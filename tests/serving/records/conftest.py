"""What the records' tests share."""

from __future__ import annotations

import subprocess

import pytest


@pytest.fixture
def stranger():
    """`setsid sleep 1000`: a process of this user that the project did not launch, which no readable record
    proves is a server's: it must never be signalled."""
    p = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    yield p
    p.kill()
    p.wait()
