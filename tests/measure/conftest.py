"""Fixtures of the measuring commands' tests."""

from __future__ import annotations

import pytest

from tests.helpers.stand_ins.measure import MeasureStandIn, serve_in_thread


@pytest.fixture(scope="module")
def measure_stand_in():
    """The URL of a stand-in of vLLM's HTTP API that answers the sweep's and the capacity search's requests, one
    for the module's tests."""
    with serve_in_thread(MeasureStandIn) as url:
        yield url
