"""A run id's digest has one home (evidence.run_digest), used by the sweep, the capacity search and the evals: the
same parameters give the same digest, whatever order their keys come in, and the figures runs already carry."""

from __future__ import annotations

import re

from tools.measure import evidence


def test_the_digest_of_a_runs_parameters_is_stable_and_order_free():
    ident = {"tasks": ["x"], "limit": 2, "model": "m"}
    assert evidence.run_digest(ident) == "040f3876"  # what run folders written before it already end with
    assert evidence.run_digest(dict(reversed(list(ident.items())))) == "040f3876"
    assert evidence.run_digest(["p95 ttft < 1 s", {"a": 1}, "poisson", 128]) == "d1ef976c"
    assert evidence.run_digest({"limit": 3}) != evidence.run_digest({"limit": 2})


def test_a_run_id_ends_with_its_digest():
    name = evidence.run_id("sweep", "base", evidence.run_digest({"a": 1}))
    assert re.fullmatch(r"sweep-\d{8}-\d{6}-base-[0-9a-f]{8}", name) and name.endswith(evidence.run_digest({"a": 1}))
