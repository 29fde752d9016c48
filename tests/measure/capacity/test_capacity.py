"""The capacity search over synthetic servers (measure callables), the SLO text, the command line's refusals and
find_capacity's argument errors: no vLLM here (test_capacity_vllm.py searches a real server)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tools.core.errors import BadInput
from tools.measure.capacity.search import Sample, search_capacity
from tools.measure.capacity.slo import goodput_limits, parse_slo, slo_text

ROOT = Path(__file__).resolve().parents[3]
SLO = parse_slo("ttft_p99_ms=1000,tpot_p99_ms=100")


class Server:
    """A synthetic server: p99 TTFT 100 ms per concurrent user, TPOT 10 ms + 2 per user, each repeat off by
    `wobble` (alternating signs, so a point's interval is about that wide). Records the loads it was asked."""

    def __init__(self, ttft_per_user: float = 100.0, wobble: float = 0.01) -> None:
        self.ttft_per_user, self.wobble, self.asked = ttft_per_user, wobble, []

    def __call__(self, load: float) -> Sample:
        self.asked.append(load)
        f = [1 + self.wobble, 1 - self.wobble]
        return Sample(values={"p99_ttft_ms": [self.ttft_per_user * load * x for x in f],
                              "p99_tpot_ms": [(10 + 2 * load) * x for x in f]})


def test_the_search_brackets_by_doubling_then_bisects_in_few_points():
    s = Server(wobble=0.001)  # TTFT p99 900 ms at 9 users, 1000 at 10: within 950 up to 9
    res = search_capacity(s, parse_slo("ttft_p99_ms=950,tpot_p99_ms=100"), max_load=64)
    assert res.status == "found" and res.capacity == 9 and (res.last_pass, res.first_fail) == (9, 10)
    # 1, 2, 4, 8, 16 bracket [8, 16); 12, 10, 9 bisect: 8 points, never a grid.
    assert s.asked == [1, 2, 4, 8, 16, 12, 10, 9]
    cap = res.point(9)
    assert cap.passed and [t.verdict for t in cap.terms] == ["pass", "pass"]
    assert cap.terms[0].value == pytest.approx(900) and cap.terms[0].low < 900 < cap.terms[0].high


def test_too_strict_an_slo_is_none_and_too_loose_a_lower_bound():
    s = Server()
    res = search_capacity(s, parse_slo("ttft_p99_ms=50"), max_load=64)
    assert res.status == "none" and res.capacity is None and res.first_fail == 1 and s.asked == [1]
    s = Server()
    res = search_capacity(s, parse_slo("ttft_p99_ms=100000"), max_load=20)
    assert res.status == "lower_bound" and res.capacity == 20 and res.first_fail is None
    assert s.asked == [1, 2, 4, 8, 16, 20]


def test_max_num_seqs_caps_the_search_and_says_so():
    s = Server()
    res = search_capacity(s, parse_slo("ttft_p99_ms=100000"), max_load=64, max_num_seqs=8)
    assert res.status == "bounded_by_max_num_seqs" and res.capacity == 8 and res.bounded_by == "max_num_seqs"
    assert s.asked == [1, 2, 4, 8]


def test_a_point_within_its_noise_is_measured_again():
    # 10 users give 1000 ms against a 1000 ms limit, with a 5% wobble: the interval holds the limit.
    s = Server(wobble=0.05)
    res = search_capacity(s, parse_slo("ttft_p99_ms=1000"), max_load=16, noise_rounds=1)
    assert s.asked.count(10) == 2  # measured again, its repeats pooled
    p = res.point(10)
    assert p.rounds == 2 and p.repeats == 4 and p.within_noise
    assert res.capacity in (9, 10) and res.status == "found"
    # A clear point is measured once: two repeats give a wide interval (Student t with one degree of freedom).
    assert s.asked.count(1) == 1 and not res.point(1).within_noise


def test_a_request_rate_search_bisects_geometrically_to_the_tolerance():
    s = Server(wobble=0.001)
    res = search_capacity(s, parse_slo("ttft_p99_ms=350"), max_load=64, integer=False, rel_tol=0.1)
    assert res.status == "found" and res.first_fail / res.last_pass <= 1.1
    assert res.last_pass <= 3.5 < res.first_fail
    assert s.asked[:3] == [1, 2, 4] and len(s.asked) == len(set(s.asked)) <= 7


def test_a_failed_measurement_stops_the_search_with_its_reason():
    def broken(load: float) -> Sample:
        return Sample(failed="server gone") if load > 2 else Server()(load)

    res = search_capacity(broken, SLO, max_load=64)
    assert res.status == "error" and res.capacity == 2 and "server gone" in res.reason


def test_slo_text_parses_and_names_the_bad_term():
    terms = parse_slo(" ttft_p99_ms=1000, tpot_p90_ms=100 ,e2el_p50_ms=5000,itl_p99_ms=80")
    assert [t.key for t in terms] == ["p99_ttft_ms", "p90_tpot_ms", "p50_e2el_ms", "p99_itl_ms"]
    assert slo_text(terms) == "ttft_p99_ms=1000,tpot_p90_ms=100,e2el_p50_ms=5000,itl_p99_ms=80"
    assert goodput_limits(terms) == {"ttft": 1000, "tpot": 100, "e2el": 5000}  # itl is per token: not counted
    assert goodput_limits(parse_slo("ttft_p50_ms=200,ttft_p99_ms=1000")) == {"ttft": 200}
    for bad, why in (("ttft=fast", "'ttft=fast': unknown metric"), ("speed_p99_ms=3", "unknown metric"),
                     ("ttft_p99_ms=-5", "must be a positive"), ("ttft_p99_ms=fast", "not a number"),
                     ("ttft_p99_ms=1,ttft_p99_ms=2", "given twice"), ("ttft_p95_ms=1", "p95 is not measured"),
                     ("ttft_p99_ms", "no =LIMIT"), ("", "empty")):
        with pytest.raises(BadInput, match=why) as exc:
            parse_slo(bad)
        assert exc.value.field == "slo"


def test_the_command_refuses_bad_input_in_one_line_with_status_2_and_writes_nothing(tmp_path, capsys):
    from tools.cli import main

    out = tmp_path / "ev"
    for args, says in ((["--slo", "ttft=fast"], "--slo term 'ttft=fast': unknown metric"),
                       (["--slo", "ttft_p99_ms=-1"], "must be a positive"),
                       (["--slo", "ttft_p99_ms=1,ttft_p99_ms=1"], "given twice"),
                       (["--max", "4", "--start", "8"], "start <= max"),
                       (["--load", "concurrency", "--max", "2.5"], "whole numbers")):
        code = main(["capacity", *args, "--out", str(out), "--base-url", "http://127.0.0.1:9"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert not out.exists()


def test_find_capacity_refuses_bad_arguments_before_anything_runs(tmp_path):
    from fastmcp import Client
    from fastmcp.exceptions import ToolError

    from tools.core.paths import Roots
    from tools.mcp.app import Settings, create_server

    (tmp_path / "models").mkdir()
    (tmp_path / "evidence").mkdir()
    roots = Roots.from_env([str(tmp_path / "models")], [str(tmp_path / "evidence")], environ={})
    mcp = create_server(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")}),
                        toolsets="capacity")

    async def go():
        async with Client(mcp) as c:
            with pytest.raises(ToolError, match="slo term 'ttft=fast': unknown metric"):
                await c.call_tool("find_capacity", {"slo": "ttft=fast", "base_url": "http://127.0.0.1:9"})
            with pytest.raises(ToolError, match="outside the evidence roots"):
                await c.call_tool("find_capacity", {"out": "/tmp", "base_url": "http://127.0.0.1:9"})
            with pytest.raises(ToolError, match="start <= max"):
                await c.call_tool("find_capacity", {"start": 8, "max_load": 4, "base_url": "http://127.0.0.1:9"})

    asyncio.run(go())
    assert list((tmp_path / "evidence").iterdir()) == []


def test_a_rate_point_asks_vllm_for_poisson_arrivals_and_goodput():
    from tools.measure.sweep.params import CellSpec, raw_name
    from tools.measure.sweep.worker import _bench_argv

    spec = CellSpec(base_url="http://h", model="m", tokenizer="t", input_len=32, output_len=8, concurrency=0,
                    request_rate=2.5, goodput={"ttft": 1000.0, "tpot": 100.0}, num_prompts=10, repeats=(1,),
                    seeds={1: 7}, warmup_seed=None, warmup_prompts=2, raw_dir="raw", log_file="raw/L32-q2.5.log")
    argv = _bench_argv(spec, 7, 10)
    assert "--max-concurrency" not in argv and argv[argv.index("--request-rate") + 1] == "2.5"
    assert argv[argv.index("--goodput") + 1:] == ["ttft:1000", "tpot:100"]
    argv = _bench_argv(spec.model_copy(update={"concurrency": 4, "request_rate": None, "goodput": None}), 7, 10)
    assert argv[argv.index("--max-concurrency") + 1] == "4" and "--request-rate" not in argv
    assert "--goodput" not in argv
    assert raw_name(32, 0, 1, 2.5) == "L32-q2.5-r1.json" and raw_name(32, 4, 1) == "L32-c4-r1.json"
