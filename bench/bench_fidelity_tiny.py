"""Fidelity of the tiny model's two builds on vLLM's CPU backend, per serving dtype, plus start time and speed.

For each dtype: serve the bf16-embedding build (the reference), record logprobs over the shipped corpus and greedy
tokens (8 short prompts + the long-context needle prompts), measure start time and decode speed; then serve the
int4-embedding build and check both against the reference. In float16 the bf16-embedding build is also checked
against its own bfloat16 reference, which measures what the serving dtype alone changes.

    flock /tmp/gemma4-vllm.lock .venv/bin/python bench/bench_fidelity_tiny.py --out evidence/fidelity-tiny.json

The tiny model is built with max_position_embeddings raised to 16,384 so that the ~14k-token prompts fit.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decode_speed(base_url: str, model: str, *, requests: int = 4, prompt_len: int = 256, max_tokens: int = 128):
    """Sequential greedy completions of fixed token prompts, EOS ignored: output tokens per second."""
    ids = [16 + (i * 37) % 256 for i in range(prompt_len)]
    with httpx.Client(timeout=600) as c:
        c.post(f"{base_url}/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 8,
                                                   "temperature": 0, "ignore_eos": True}).raise_for_status()
        t0 = time.monotonic()
        n = 0
        for _ in range(requests):
            r = c.post(f"{base_url}/v1/completions", json={"model": model, "prompt": ids, "max_tokens": max_tokens,
                                                           "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            n += r.json()["usage"]["completion_tokens"]
        return n / (time.monotonic() - t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="JSON file for the figures")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--full-dtypes", default="float16",
                    help="dtypes in which the emb4 build is compared too (the others: the reference's speed and "
                         "logprobs only)")
    ap.add_argument("--source-dtypes", default="float16",
                    help="dtypes in which the unquantized QAT source is also served as a reference")
    ap.add_argument("--objective", default=None, choices=["runtime-exact", "min-error"],
                    help="the scale objective both builds are made with (default: the library's); run once per "
                         "objective to compare them")
    ap.add_argument("--work", default=None, help="folder for the builds (default: a temporary one)")
    ap.add_argument("--tiny", default=None, help="an already built tiny QAT checkpoint to reuse (its position "
                                                 "limit is raised in a copy) instead of training one")
    args = ap.parse_args()
    import signal

    # A timeout's SIGTERM must still run the `finally: stop_server(...)` blocks.
    def terminated(*_):
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, terminated)

    from repack.build.build import BuildOptions, build_checkpoint
    from repack.stand_ins import tiny_model
    from tools.measure.tokens.compare import TokenCompareParams, check_against, record_reference
    from tools.serving.config import load_config
    from tools.measure.fidelity.run import CheckLogprobsParams, RecordLogprobsParams, check_logprobs, record_logprobs
    from tools.serving import start_server, stop_server

    work = Path(args.work or tempfile.mkdtemp(prefix="fidelity-tiny-"))
    if args.tiny:
        import shutil

        src = work / "gemma-4-tiny-qat"
        shutil.copytree(args.tiny, src, dirs_exist_ok=True)
        cfg_path, tok_path = src / "config.json", src / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["text_config"]["max_position_embeddings"] = 16384
        cfg_path.write_text(json.dumps(cfg, indent=2))
        tok = json.loads(tok_path.read_text())
        tok["model_max_length"] = 16384
        tok_path.write_text(json.dumps(tok, indent=2))
        info = tiny_model.TinyModelInfo(path=src, accuracy=float("nan"), grid_tensors=[], permutation_seed=0)
    else:
        tiny_model.TEXT_CONFIG["max_position_embeddings"] = 16384
        info = tiny_model.build_tiny_qat_checkpoint(work / "gemma-4-tiny-qat")
    builds = {
        "bf16-embeddings": work / "gemma-4-tiny-text",
        "emb4": work / "gemma-4-tiny-text-emb4",
    }
    from repack.choices import DEFAULT_OBJECTIVE

    objective = args.objective or DEFAULT_OBJECTIVE
    build_checkpoint(info.path, builds["bf16-embeddings"],
                     BuildOptions(quantize_linears=True, text_only=True, embed_int4=False, embed_tokens=False,
                                  objective=objective, force=True))
    build_checkpoint(info.path, builds["emb4"], BuildOptions(text_only=True, embed_int4=True, embed_tokens=True,
                                                             objective=objective, force=True))
    builds["source"] = info.path
    # vLLM's CPU backend may not serve the multimodal source; a rename-only text copy (bf16, nothing packed) is
    # numerically the same reference
    builds["source-text"] = work / "gemma-4-tiny-text-bf16"
    build_checkpoint(info.path, builds["source-text"],
                     BuildOptions(quantize_linears=False, text_only=True, embed_int4=False, embed_tokens=False,
                                  force=True))
    report: dict = {"tiny_pattern_accuracy": None if args.tiny else info.accuracy, "objective": objective,
                    "dtypes": {}}

    def serve(build: str, dtype: str):
        cfg = load_config(ROOT / "tpu.env", model=str(builds[build]), served_name=f"tiny-{build}",
                          host="127.0.0.1", port=free_port(), state_dir=work / f"state-{build}-{dtype}",
                          max_model_len=16384, max_num_seqs=8, cpu_kvcache_space_gib=1, speculative_config="",
                          extra_args="", start_timeout_s=900.0, cpu_dtype=dtype)
        t0 = time.monotonic()
        res = start_server(cfg)
        return cfg, res, time.monotonic() - t0

    for dtype in args.dtypes.split(","):
        d: dict = {}
        ref = work / f"ref-{dtype}.json"
        tokens = work / f"tokens-{dtype}.json"
        src_ref = work / f"ref-source-{dtype}.json"
        if dtype in args.source_dtypes.split(","):
            for which in ("source", "source-text"):
                try:
                    cfg, res, wall = serve(which, dtype)
                    try:
                        d["start_s_source"] = round(wall, 1)
                        record_logprobs(RecordLogprobsParams(out=str(src_ref), base_url=cfg.base_url, force=True))
                        d["source_reference"] = which
                    finally:
                        stop_server(cfg)
                    break
                except Exception as exc:  # the source reference is optional: record why it is missing
                    d[f"{which}_error"] = f"{type(exc).__name__}: {exc}"

        def against_source(base_url: str) -> dict | None:
            if not src_ref.is_file():
                return None
            return check_logprobs(CheckLogprobsParams(reference=str(src_ref), base_url=base_url)).to_dict()

        cfg, res, wall = serve("bf16-embeddings", dtype)
        try:
            d["start_s_bf16_embeddings"] = round(wall, 1)
            rec = record_logprobs(RecordLogprobsParams(out=str(ref), base_url=cfg.base_url, force=True))
            d["record"] = rec.to_dict()
            d["prompt_logprobs_tok_s"] = round(rec.tokens / rec.wall_s, 1)
            full = dtype in args.full_dtypes.split(",")
            if full:
                t0 = time.monotonic()
                record_reference(tokens, TokenCompareParams(base_url=cfg.base_url, long=True))
                d["greedy_record_s"] = round(time.monotonic() - t0, 1)
            d["decode_tok_s_bf16_embeddings"] = round(decode_speed(cfg.base_url, cfg.served_name), 1)
            d["kld_bf16_embeddings_vs_source"] = against_source(cfg.base_url)
            if dtype == "float16" and (work / "ref-bfloat16.json").is_file():
                d["same_build_float16_vs_bfloat16"] = check_logprobs(CheckLogprobsParams(
                    reference=str(work / "ref-bfloat16.json"), base_url=cfg.base_url)).to_dict()
        finally:
            stop_server(cfg)
        if not full:
            report["dtypes"][dtype] = d
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
            print(f"{dtype}: start {d['start_s_bf16_embeddings']} s, decode {d['decode_tok_s_bf16_embeddings']} tok/s",
                  flush=True)
            continue
        cfg, res, wall = serve("emb4", dtype)
        try:
            d["start_s_emb4"] = round(wall, 1)
            d["kld_emb4_vs_bf16_embeddings"] = check_logprobs(CheckLogprobsParams(reference=str(ref),
                                                                                  base_url=cfg.base_url)).to_dict()
            d["kld_emb4_vs_source"] = against_source(cfg.base_url)
            greedy = check_against(tokens, TokenCompareParams(base_url=cfg.base_url))
            d["greedy_emb4_vs_bf16_embeddings"] = greedy.to_dict()
            d["decode_tok_s_emb4"] = round(decode_speed(cfg.base_url, cfg.served_name), 1)
        finally:
            stop_server(cfg)
        report["dtypes"][dtype] = d
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        k = d["kld_emb4_vs_bf16_embeddings"]
        print(f"{dtype}: start {d['start_s_bf16_embeddings']}/{d['start_s_emb4']} s, decode "
              f"{d['decode_tok_s_bf16_embeddings']}/{d['decode_tok_s_emb4']} tok/s, mean KLD {k['mean_kld']:.3g}, "
              f"p99 {k['p99_kld']:.3g}, max {k['max_kld']:.3g}, top-1 {k['top1_agreement']:.4f}, PPL ratio "
              f"{k['ppl_ratio']:.5f}, greedy {greedy.identical}/{greedy.total}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
