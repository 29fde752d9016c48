"""The memory-bandwidth roofline: the article's arithmetic, the bytes of a build at E2B's real shapes (planned
from headers, no data written), the KV layout, NVML's bandwidth and the CPU copy benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from repack.source.checkpoint import open_checkpoint
from repack.params import BuildOptions
from repack.build.plan import output_config, plan
from repack.stand_ins.synthetic import e2b_config, e2b_tensors, write_e2b_checkpoint, write_safetensors
from tools.gpu.vram import memory_bandwidth
from tools.measure.roofline import (Bandwidth, StepBytes, copy_buffer_bytes, cpu_copy_bandwidth, decode_step_bytes,
                                    device_bandwidth, kv_bytes_per_token_at, roofline, single_stream_roofline,
                                    sweep_cell_roofline)

GIB = 2**30


class StandInNvml:
    """pynvml's calls for one Tesla T4."""

    NVML_CLOCK_MEM = 2

    def __init__(self, gpus: int = 1) -> None:
        self.gpus = gpus

    def nvmlInit(self) -> None:
        if not self.gpus:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryBusWidth(self, h: int) -> int:
        return 256

    def nvmlDeviceGetMaxClockInfo(self, h: int, kind: int) -> int:
        assert kind == self.NVML_CLOCK_MEM
        return 5001

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"Tesla T4"


def test_nvml_bandwidth_of_a_t4_is_bus_width_times_clock_times_two():
    bw = memory_bandwidth(0, nvml=StandInNvml())
    assert bw is not None and bw.name == "Tesla T4"
    assert bw.bytes_per_s == 256 * 5001e6 * 2 / 8 == pytest.approx(320.064e9)
    assert "256-bit bus x 5001 MHz" in bw.method
    assert memory_bandwidth(0, nvml=StandInNvml(gpus=0)) is None
    assert memory_bandwidth(1, nvml=StandInNvml()) is None
    assert device_bandwidth(nvml=StandInNvml()).device == "Tesla T4"


def _article_step(*, linears_and_norms_gib: float, output_gib: float, tied: bool) -> StepBytes:
    # Rows: embed_tokens 1536 values, PLE 35 x 256 = 8960 values; 4-bit (+ fp16 scale per 32) or 2-byte.
    four = not tied
    embed_row = 1536 // 2 + 1536 // 32 * 2 if four else 1536 * 2
    ple_row = 8960 // 2 + 8960 // 32 * 2 if four else 8960 * 2
    return StepBytes(linears=round(linears_and_norms_gib * GIB), output_layer=round(output_gib * GIB),
                     embed_rows=embed_row, ple_rows=ple_row, other=0,
                     kv_cache=kv_bytes_per_token_at(e2b_config(e2b_tensors(1.0)), 150), context_tokens=150,
                     output_tied=tied)


def test_the_articles_decode_is_44_percent_of_the_t4_roofline():
    """The article's sizes: the all-4-bit checkpoint is 2.64 GiB, of which PLE 1.230, embed_tokens 0.211 and
    lm_head 0.211 GiB; the bf16-embedding one 6.11 GiB with PLE 4.375 and the tied embed_tokens 0.750 GiB.
    A step reads everything but the two tables, whose token rows it gathers, plus the output layer."""
    t4 = device_bandwidth(nvml=StandInNvml())
    emb4 = _article_step(linears_and_norms_gib=2.64 - 1.230 - 0.211 - 0.211, output_gib=0.211, tied=False)
    bf16 = _article_step(linears_and_norms_gib=6.11 - 4.375 - 0.750, output_gib=0.750, tied=True)
    r4, r16 = roofline(109.7, emb4, t4), roofline(81.6, bf16, t4)
    assert r4.fraction == pytest.approx(0.44, abs=0.005)
    assert r4.achieved_bytes_per_s == pytest.approx(141e9, rel=0.01)
    assert r4.roofline_tok_s == pytest.approx(248.6, rel=0.01)
    assert r16.fraction == pytest.approx(0.475, abs=0.005)
    # The bytes predict 1.45x for the all-4-bit build; the article measured 109.7 / 81.6 = 1.34x.
    assert bf16.total / emb4.total == pytest.approx(1.447, abs=0.005)
    assert "44% of the memory-bandwidth roofline" in r4.line() and "NVML" in r4.line()


def test_kv_bytes_follow_layer_types_head_dims_sharing_and_the_window():
    cfg = e2b_config(e2b_tensors(1.0))
    # 15 layers own a cache: 12 sliding (head 256) and 3 full (head 512); one KV head, K and V, 2 bytes.
    per_token = 12 * 2 * 256 * 2 + 3 * 2 * 512 * 2
    assert kv_bytes_per_token_at(cfg, 100) == 100 * per_token
    assert kv_bytes_per_token_at(cfg, 2048) == 12 * 2 * 256 * 2 * 512 + 3 * 2 * 512 * 2 * 2048
    # transformers' own spelling (per_layer_config instead of global_head_dim) gives the same bytes.
    tc = dict(cfg["text_config"])
    del tc["global_head_dim"]
    tc["per_layer_config"] = {str(i): {"head_dim": 512} for i, t in enumerate(tc["layer_types"])
                              if t == "full_attention"}
    assert kv_bytes_per_token_at(tc, 100) == 100 * per_token


def test_synthetic_config_is_what_gemma4s_config_classes_accept():
    from transformers import Gemma4Config, Gemma4TextConfig

    from repack.family.config import text_only

    cfg = e2b_config(e2b_tensors(1.0))
    text = Gemma4Config(**cfg).text_config
    assert (text.num_hidden_layers, text.hidden_size, text.vocab_size, text.num_kv_shared_layers) == \
        (35, 1536, 262144, 20)
    assert [i for i, t in enumerate(text.layer_types) if t == "full_attention"] == list(range(4, 35, 5))
    assert [text.per_layer_config[i].head_dim for i in range(4, 35, 5)] == [512] * 7
    flat = Gemma4TextConfig(**{k: v for k, v in text_only(cfg).items() if k != "architectures"})
    assert flat.sliding_window == 512 and flat.use_double_wide_mlp


def _planned_build(tmp_path: Path, opt: BuildOptions) -> Path:
    """The build's config and shard headers as the one-pass repack plans them, data left sparse."""
    src = tmp_path / "src"
    write_e2b_checkpoint(src, 1.0, fill="none")
    ck = open_checkpoint(src)
    items, shards = plan(ck, opt)
    out = tmp_path / ("emb4" if opt.embed_int4 else "bf16emb")
    out.mkdir()
    (out / "config.json").write_text(json.dumps(output_config(ck, opt, items)))
    for sh in shards:
        with open(out / sh.filename, "wb") as f:
            f.write(sh.layout({"format": "pt"}))
            f.truncate(sh.size)
    return out


def test_all_4bit_build_at_real_shapes_is_2_636_gib_and_its_step_bytes_match_its_tensors(tmp_path):
    from repack.source.safetensors_io import read_header

    out = _planned_build(tmp_path, BuildOptions(text_only=True, embed_int4=True, embed_tokens=True))
    tensors = {n: t for f in out.glob("*.safetensors") for n, t in read_header(f).tensors.items()}
    total = sum(t.nbytes for t in tensors.values())
    assert total / GIB == pytest.approx(2.636, abs=0.001)
    step = decode_step_bytes(out, 150)
    tables = [t for n, t in tensors.items() if ".embed_tokens" in n]
    rows = sum(t.nbytes // t.shape[0] if len(t.shape) == 2 else t.nbytes for t in tables)
    assert not step.output_tied and step.output_layer == sum(t.nbytes for n, t in tensors.items()
                                                             if n.startswith("lm_head."))
    assert step.linears + step.other + step.output_layer == total - sum(t.nbytes for t in tables)
    assert step.embed_rows + step.ple_rows == rows
    assert step.kv_cache == 150 * (12 * 2 * 256 * 2 + 3 * 2 * 512 * 2)


def test_bf16_embedding_build_reads_its_tied_table_as_the_output_layer(tmp_path):
    out = _planned_build(tmp_path, BuildOptions(text_only=True, embed_int4=False, embed_tokens=False))
    step = decode_step_bytes(out, 0)
    assert step.output_tied and step.output_layer == 262144 * 1536 * 2
    assert step.embed_rows == 1536 * 2 and step.ple_rows == 35 * 256 * 2
    assert step.kv_cache == 0


def test_towers_are_not_read_and_a_hub_id_has_no_figure(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(e2b_config(e2b_tensors(1.0))))
    write_safetensors(d / "model.safetensors", [
        ("model.language_model.embed_tokens.weight", "BF16", (4, 8), b"\0" * 64),
        ("model.language_model.layers.0.mlp.up_proj.weight", "BF16", (2, 8), b"\0" * 32),
        ("model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight", "BF16", (8, 8), b"\0" * 128)])
    step = decode_step_bytes(d, 0)
    assert (step.linears, step.output_layer, step.embed_rows) == (32, 64, 16)
    bw = Bandwidth(bytes_per_s=1e9, device="cpu", method="given")
    assert single_stream_roofline(10.0, "google/gemma-4-E2B-it", 0, bandwidth=bw) is None
    assert single_stream_roofline(None, d, 0, bandwidth=bw) is None
    cell = sweep_cell_roofline(10.0, d, input_len=512, output_len=128, bandwidth=bw)
    assert cell is not None and cell.context_tokens == 576
    assert cell.step_bytes == decode_step_bytes(d, 576).total
    assert cell.fraction == pytest.approx(10.0 * cell.step_bytes / 1e9)


@pytest.mark.parametrize("value", [[4], "4", True])
def test_a_config_shape_of_the_wrong_type_is_named_not_counted(tmp_path, value):
    """The roofline reads config.json through the project's one config reader: a layer count of the wrong type is
    the reason named (by key) for no figure, not a bare TypeError, nor a string "4" counted as 4."""
    from tools.measure.roofline import roofline_or_reason

    d = tmp_path / "m"
    d.mkdir()
    cfg = e2b_config(e2b_tensors(1.0))
    cfg["text_config"]["num_hidden_layers"] = value
    (d / "config.json").write_text(json.dumps(cfg))
    write_safetensors(d / "model.safetensors", [("model.language_model.embed_tokens.weight", "BF16", (4, 8),
                                                 b"\0" * 64)])
    fig, why = roofline_or_reason(10.0, str(d), 0)
    assert fig is None and "text_config.num_hidden_layers" in why and "not a whole number" in why, why


def test_cpu_copy_bandwidth_is_measured_and_says_how(monkeypatch):
    bw = cpu_copy_bandwidth(buffer_bytes=4 << 20, repeats=2)
    assert bw.device == "cpu" and bw.bytes_per_s > 0
    assert "numpy copy of 4 MiB" in bw.method and "best of 2" in bw.method
    import tools.measure.roofline as rl

    monkeypatch.setattr(rl, "_CPU_BANDWIDTH", bw)  # cached per process: no second measurement
    assert device_bandwidth(nvml=StandInNvml(gpus=0)) is bw


def test_the_copy_buffer_is_well_above_the_cache_but_bounded():
    mib = 1 << 20
    assert copy_buffer_bytes(0) == 256 * mib
    assert copy_buffer_bytes(32 * mib) == 256 * mib
    assert copy_buffer_bytes(64 * mib) == 512 * mib
    assert copy_buffer_bytes(480 * mib) == 1024 * mib   # a VM reporting the host's L3
    assert copy_buffer_bytes(1024 * mib) == 2048 * mib  # still twice the cache


def _cell(input_len: int, c: int, tpots: list[float]):
    from tools.measure.sweep.params import CellResult, RepeatResult, aggregate

    reps = [RepeatResult(repeat=i, seed=i, status="ok", num_prompts=2,
                         metrics={"mean_tpot_ms": t, "output_throughput": 1000.0 / t}) for i, t in enumerate(tpots)]
    median, spread = aggregate(reps)
    return CellResult(input_len=input_len, output_len=16, concurrency=c, num_prompts=2, status="ok", repeats=reps,
                      median=median, spread_pct=spread)


def test_a_sweeps_single_stream_cells_carry_their_share_of_the_roofline(tmp_path, monkeypatch):
    """Each c=1 cell's decode rate (1000 / mean TPOT, not out tok/s, which holds the prefill) as a share of the
    roofline, per input length, in the result and its table; none for other loads, and a reason for a hub id."""
    import tools.measure.roofline as rl
    from tools.measure.sweep.params import SweepResult
    from tools.measure.sweep.run import single_stream_rooflines
    from tools.measure.sweep.report import markdown_run

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(e2b_config(e2b_tensors(1.0))))
    write_safetensors(d / "model.safetensors", [
        ("model.language_model.embed_tokens.weight", "BF16", (4, 8), b"\0" * 64),
        ("model.language_model.layers.0.mlp.up_proj.weight", "BF16", (2, 8), b"\0" * 32)])
    monkeypatch.setattr(rl, "_CPU_BANDWIDTH", Bandwidth(bytes_per_s=1e6, device="cpu", method="given"))
    res = SweepResult(run_id="r", run_dir=str(tmp_path), label="x", params={"output_len": 16, "repeats": 2},
                      started="2026-12-02T00:00:00+00:00",
                      cells=[_cell(32, 1, [20.0, 20.0]), _cell(32, 2, [40.0, 40.0]), _cell(64, 1, [25.0, 25.0])])
    figs, note = single_stream_rooflines(res, str(d))
    assert note is None and set(figs) == {32, 64}
    assert figs[32].tok_s == pytest.approx(50.0) and figs[64].tok_s == pytest.approx(40.0)
    assert figs[32].context_tokens == 32 + 8 and figs[32].step_bytes == decode_step_bytes(d, 40).total
    assert figs[32].fraction == pytest.approx(50.0 * figs[32].step_bytes / 1e6)
    res.roofline = figs
    md = markdown_run(res)
    assert md.count("Single stream (c=1), decode tok/s = 1000 / TPOT mean as a share of the roofline") == 2
    assert figs[32].line() in md
    figs, note = single_stream_rooflines(res, "google/gemma-4-E2B-it")
    assert figs == {} and "not a local folder" in note
    res.roofline, res.roofline_note = figs, note
    assert "Roofline: none (the served model" in markdown_run(res)


def test_a_stand_ins_share_of_the_roofline_is_not_applicable_not_0_percent():
    """A tiny stand-in reads about 1 MiB a step: caches and fixed costs set its rate, so its share of the
    memory-bandwidth roofline is n/a (said why), where a real build's (2.6 GiB a step) is a percentage."""
    from tools.measure.roofline import MIN_STEP_BYTES, StepBytes, roofline

    bw = Bandwidth(bytes_per_s=12e9, device="cpu", method="given")
    tiny = roofline(12.2, StepBytes(linears=1 << 20, output_layer=0, embed_rows=0, ple_rows=0, other=0, kv_cache=0,
                                    context_tokens=576, output_tied=True), bw)
    assert not tiny.applicable and tiny.share() == "n/a"
    assert tiny.line().startswith("n/a: a step reads 1.00 MiB") and "%" not in tiny.line()
    real = roofline(12.2, StepBytes(linears=MIN_STEP_BYTES * 40, output_layer=0, embed_rows=0, ple_rows=0, other=0,
                                    kv_cache=0, context_tokens=576, output_tied=True), bw)
    assert real.applicable and real.line().startswith(f"{real.share()} of the memory-bandwidth roofline")
    assert type(tiny).model_validate(tiny.model_dump()).applicable is False  # read back from a summary.json


def test_kv_bytes_a_token_are_the_fit_planners_for_every_member():
    """One home for a token's KV bytes (repack.fit.kv_bytes_per_token): the roofline counts what the planner
    sizes the pool with, the full layers' own KV heads (num_global_key_value_heads) included."""
    from repack.build.fit import kv_layout
    from repack.family.members import MEMBERS

    for m in MEMBERS.values():
        kinds = kv_layout(m)["kinds"].values()
        assert kv_bytes_per_token_at({"text_config": m.text_config()}, 1) == \
            sum(k["layers"] * k["bytes_per_token"] for k in kinds), m.name
    tc = MEMBERS["12B"].text_config()  # 8 KV heads on sliding layers, 1 on full ones, head 256/512
    full = tc["layer_types"].count("full_attention")
    assert kv_bytes_per_token_at(tc, 1) == (48 - full) * 2 * 8 * 256 * 2 + full * 2 * 1 * 512 * 2
