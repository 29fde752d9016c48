"""Against a second, different build: token divergences between builds, and a sweep whose server is killed
(SIGKILL) mid-run, which status reports as died and stop cleans up. The killed server is the session's
`perturbed_server`: its test is marked ends_shared_server, so it runs after every other test that uses it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tools.measure.tokens.compare import TokenCompareParams, check_against, compare_live, record_reference
from tools.measure.sweep.params import SweepParams
from tools.measure.sweep.run import run_sweep
from tools.measure.sweep.params import raw_name

from tests.helpers.fixtures import group_alive

pytestmark = pytest.mark.vllm



@pytest.fixture(scope="module")
def other_server(perturbed_server):
    """The second build: the int4-embedding build with wrong scales on two layers and the head (the session's
    `perturbed_server`, shared with the fidelity negative control), so greedy tokens diverge from `emb4_server`'s."""
    return perturbed_server[0]


def test_different_builds_report_divergences_with_positions(emb4_server, other_server):
    res = compare_live(emb4_server.base_url, other_server.base_url, TokenCompareParams(max_tokens=32))
    assert res.total == 8
    assert res.identical < 8, res.text()
    for p in res.prompts:
        if p.same_tokens:
            continue
        assert p.verdict in ("near-tie", "divergence", "length")
        assert isinstance(p.first_divergence, int) and 0 <= p.first_divergence < 32
        if p.verdict != "length":
            assert p.reference_token != p.candidate_token
            assert p.candidate_in_reference_topk is not None and p.reference_in_candidate_topk is not None
    text = res.text()
    assert "SAME TOKENS: False" in text and "first divergence at token" in text
    assert f"{res.identical} of 8 prompts token-identical" in text


def test_recorded_reference_against_another_build(emb4_server, other_server, tmp_path):
    ref = tmp_path / "emb4.json"
    rec = record_reference(ref, TokenCompareParams(base_url=emb4_server.base_url, max_tokens=24, top_logprobs=3))
    res = check_against(ref, TokenCompareParams(base_url=other_server.base_url))
    assert res.total == 8 and res.identical < 8
    # The recorded side's tokens are what the check compared against.
    for p, g in zip(res.prompts, rec.generations):
        assert p.reference_len == len(g.token_ids)
        if not p.same_tokens and p.verdict != "length":
            assert g.token_ids[p.first_divergence] == p.reference_token


@pytest.mark.ends_shared_server
def test_server_dying_mid_run_keeps_finished_cells_and_fails_the_rest(other_server, tmp_path):
    """Runs after every other vllm test (conftest's collection hook): it kills the server's leader (SIGKILL) while the sweep's second
    cell starts, checks that status reports it died, then lets stop end what is left of its process group."""
    from tools.serving.server.server import server_status, stop_server

    seen: dict = {}

    def progress(done: int, total: int, msg: str) -> None:
        if "c=2: measuring" in msg and not seen:  # after the health check of cell 2, before its benchmark process
            st = server_status(other_server)
            seen["pid"], seen["pgid"] = st.pid, json.loads(other_server.state_file.read_text())["pgid"]
            os.kill(st.pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                st = server_status(other_server)
                if not st.alive:
                    break
                time.sleep(0.5)
            seen["status"] = st
            stop_server(other_server, grace_s=5)  # ends the leader's orphans (the engine core)
            seen["left"] = group_alive(seen["pgid"])

    params = SweepParams(base_url=other_server.base_url, input_lens=[32], output_len=8, concurrencies=[1, 2, 3],
                         repeats=2, prompts_per_concurrency=1, min_prompts=2, label="dies", out=tmp_path,
                         cell_timeout_s=300)
    res = run_sweep(params, progress=progress)
    assert [c.status for c in res.cells] == ["ok", "failed", "failed"], [c.reason for c in res.cells]
    raw = Path(res.run_dir) / "raw"
    assert all((raw / raw_name(32, 1, k)).is_file() for k in range(2))
    c2, c3 = res.cells[1], res.cells[2]
    assert all(r.status == "failed" and r.reason for r in c2.repeats + c3.repeats)
    assert "/health" in c3.reason  # the server was already gone when cell 3 came up
    saved = json.loads((Path(res.run_dir) / "summary.json").read_text())
    assert [c["status"] for c in saved["cells"]] == ["ok", "failed", "failed"]
    assert saved["cells"][0]["median"]["completed"] == 2
    assert (Path(res.run_dir) / "plot.png").is_file()

    st = seen["status"]
    assert not st.alive and st.died and not st.healthy
    assert str(seen["pid"]) in st.message and "died" in st.message
    assert seen["left"] == []
    assert not other_server.state_file.exists()
    assert server_status(other_server).died is False
