"""How close a single-stream decode figure is to the memory-bandwidth roofline.

At one sequence a decode step reads every weight it uses once to produce one token, so the step cannot be
faster than (bytes the step must read) / (the device's memory bandwidth). `decode_step_bytes` counts those
bytes for a build as served, from its config.json and safetensors headers:

- every linear of the text model whole, as stored (int4 `weight_packed` + `weight_scale`, or plain weights),
  and the output layer whole: `lm_head` when the build has one, else the tied `embed_tokens` table;
- of the two embedding tables (`embed_tokens` and Gemma 4's per-layer `embed_tokens_per_layer`), only the
  row of the token (packed or not);
- norms and scalars whole (they are small);
- the KV cache at the given context: K and V of every layer that owns a cache (layers past
  `num_hidden_layers - num_kv_shared_layers` reuse an earlier layer's and add no bytes), sliding layers at
  most `sliding_window` tokens, head sizes from `per_layer_config` or the hub's `global_head_dim` (and the full
  layers' `num_global_key_value_heads`), 2 bytes a value (`--kv-cache-dtype auto` at fp16/bf16): the bytes a
  token takes are the fit planner's (repack.fit.kv_bytes_per_token).
Vision and audio towers are never read in a text decode step and are left out.

The bandwidth (`device_bandwidth`): on an NVIDIA GPU NVML's bus width x maximum memory clock x 2 (double data
rate) (tools/gpu/vram.py); on a CPU a measured numpy copy of a buffer well above the last-level cache, best of
a few, counted as bytes read + written, once per process. Each figure carries the method it was made with.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, computed_field

from repack.source.checkpoint import read_config
from repack.family.config import PLE, TOWERS, text_of
from repack.build.fit import kv_bytes_per_token
from repack.source.safetensors_io import read_header
from tools.gpu.vram import memory_bandwidth

_TOWER = re.compile(rf"(^|\.)({'|'.join(TOWERS)})\.")
_PLE = re.compile(rf"(^|\.){PLE}\.")
_EMBED = re.compile(r"(^|\.)embed_tokens\.")
_HEAD = re.compile(r"(^|\.)lm_head\.")


class StepBytes(BaseModel):
    """The bytes one single-stream decode step must read, by part."""

    linears: int = Field(description="Linear layers of the text model, whole, as stored")
    output_layer: int = Field(description="lm_head whole, or the tied embed_tokens table whole")
    embed_rows: int = Field(description="One row of embed_tokens (the token's)")
    ple_rows: int = Field(description="One row of embed_tokens_per_layer (Gemma 4's per-layer embeddings)")
    other: int = Field(description="Norms, scalars and shape records, whole")
    kv_cache: int = Field(description="K and V of the layers that own a cache, at context_tokens")
    context_tokens: int
    output_tied: bool = Field(description="True when the output layer is the tied embedding table")

    @property
    def total(self) -> int:
        return self.linears + self.output_layer + self.embed_rows + self.ple_rows + self.other + self.kv_cache


class Bandwidth(BaseModel):
    bytes_per_s: float
    device: str = Field(description="The GPU's name, or 'cpu'")
    method: str = Field(description="How the figure was obtained")


# Under this many bytes a decode step's reads can sit in a cache (the largest last-level caches, CPU or GPU, hold
# tens of MiB) and fixed per-step costs (scheduling, kernel launches, sampling) outweigh them: the tiny stand-ins
# read about 1 MiB a step, the smallest real build (E2B all-4-bit) 2.6 GiB. There the share is not applicable.
MIN_STEP_BYTES = 64 << 20


class Roofline(BaseModel):
    """A single-stream decode figure as a share of the memory-bandwidth roofline."""

    tok_s: float = Field(description="The measured single-stream decode rate")
    step_bytes: int = Field(description="Bytes one decode step must read (StepBytes.total)")
    context_tokens: int
    bandwidth_bytes_per_s: float
    roofline_tok_s: float = Field(description="bandwidth / step_bytes: the fastest a step can be")
    achieved_bytes_per_s: float = Field(description="tok_s x step_bytes")
    fraction: float = Field(description="achieved / peak bandwidth = tok_s / roofline_tok_s")
    device: str
    method: str = Field(description="How the bytes and the bandwidth were counted")

    @computed_field(description="False where a step reads under MIN_STEP_BYTES (64 MiB, a stand-in's size): "
                                "then `fraction` means nothing and is given as not applicable")
    @property
    def applicable(self) -> bool:
        return self.step_bytes >= MIN_STEP_BYTES

    def share(self) -> str:
        """The fraction as a percentage, or n/a where it means nothing (`applicable`)."""
        return f"{100 * self.fraction:.0f}%" if self.applicable else "n/a"

    def line(self) -> str:
        if not self.applicable:
            return (f"n/a: a step reads {self.step_bytes / 2**20:.2f} MiB, under {MIN_STEP_BYTES >> 20} MiB: a "
                    f"stand-in's size, where caches and fixed per-step costs, not memory bandwidth, set its "
                    f"{self.tok_s:.1f} tok/s, so no share of the memory-bandwidth roofline is given ({self.device})")
        return (f"{self.share()} of the memory-bandwidth roofline: {self.tok_s:.1f} tok/s x "
                f"{self.step_bytes / 2**30:.3f} GiB per step = {self.achieved_bytes_per_s / 1e9:.1f} GB/s of "
                f"{self.bandwidth_bytes_per_s / 1e9:.1f} GB/s ({self.device}; {self.method})")


# --------------------------------------------------------------------------------------------------------------
# Bytes per step


def kv_bytes_per_token_at(config: dict[str, Any], context_tokens: int) -> int:
    """K and V bytes of the whole cache at context_tokens: each owning layer's bytes a token (repack.fit, the
    planner's arithmetic) times its tokens, a sliding layer's at most its window."""
    window = text_of(config).get("sliding_window")
    total = 0
    for kind, per_token in kv_bytes_per_token(config):
        full = kind == "full_attention"
        tokens = context_tokens if full or not window else min(context_tokens, int(window))
        total += per_token * tokens
    return total


def _shards(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("*.safetensors"))


def decode_step_bytes(model_dir: str | Path, context_tokens: int) -> StepBytes:
    """The bytes a single-stream decode step of the build in model_dir must read at context_tokens."""
    folder = Path(model_dir)
    config = read_config(folder)  # the project's one config reader: shapes of the wrong type refused by name
    parts = {"linears": 0, "output_layer": 0, "embed_rows": 0, "ple_rows": 0, "other": 0}
    embed_whole = 0
    has_head = False
    for shard in _shards(folder):
        for name, t in read_header(shard).tensors.items():
            if _TOWER.search(name):
                continue
            row = t.nbytes // t.shape[0] if len(t.shape) >= 2 and t.shape[0] else t.nbytes
            if _PLE.search(name):
                parts["ple_rows"] += row
            elif _EMBED.search(name):
                parts["embed_rows"] += row
                embed_whole += t.nbytes
            elif _HEAD.search(name):
                parts["output_layer"] += t.nbytes
                has_head = True
            elif len(t.shape) >= 2:
                parts["linears"] += t.nbytes
            else:
                parts["other"] += t.nbytes
    if not has_head:  # tied: the output layer is a full read of the embedding table
        parts["output_layer"] = embed_whole
    return StepBytes(**parts, kv_cache=kv_bytes_per_token_at(config, context_tokens),
                     context_tokens=context_tokens, output_tied=not has_head)


# --------------------------------------------------------------------------------------------------------------
# Bandwidth


_CPU_BANDWIDTH: Bandwidth | None = None


def _last_level_cache_bytes() -> int:
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best


def copy_buffer_bytes(llc: int) -> int:
    """8x the last-level cache, at least 256 MiB, at most 1 GiB or twice the cache (two buffers are held, and
    VMs may report the host's whole L3: 480 MiB on this project's machine)."""
    return max(256 << 20, min(8 * llc, max(1 << 30, 2 * llc)))


def cpu_copy_bandwidth(*, buffer_bytes: int | None = None, repeats: int = 5) -> Bandwidth:
    """Memory bandwidth of this CPU: a numpy copy of a buffer 8x the last-level cache (at least 256 MiB; at
    most 1 GiB or twice the cache), best of `repeats`, bytes read + written over the time. Measured once per
    process."""
    global _CPU_BANDWIDTH
    if _CPU_BANDWIDTH is not None and buffer_bytes is None:
        return _CPU_BANDWIDTH
    import numpy as np

    llc = _last_level_cache_bytes()
    size = buffer_bytes or copy_buffer_bytes(llc)
    src = np.ones(size // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch: page faults are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    bw = Bandwidth(bytes_per_s=2 * src.nbytes / best, device="cpu",
                   method=f"numpy copy of {src.nbytes >> 20} MiB (last-level cache {llc >> 20} MiB), best of "
                          f"{repeats}, read + write bytes, {os.cpu_count()} CPUs")
    if buffer_bytes is None:
        _CPU_BANDWIDTH = bw
    return bw


def device_bandwidth(*, gpu_index: int = 0, nvml: Any = None) -> Bandwidth:
    """The GPU's peak memory bandwidth from NVML where there is one, else this CPU's measured copy bandwidth."""
    gpu = memory_bandwidth(gpu_index, nvml=nvml)
    if gpu is not None:
        return Bandwidth(bytes_per_s=gpu.bytes_per_s, device=gpu.name, method=gpu.method)
    return cpu_copy_bandwidth()


# --------------------------------------------------------------------------------------------------------------
# The figure


def roofline(tok_s: float, step: StepBytes, bandwidth: Bandwidth) -> Roofline:
    """tok_s as a share of the roofline of `step` bytes per token at `bandwidth`."""
    total = step.total
    method = (f"bytes per step: linears and output layer whole, embedding rows gathered, KV at "
              f"{step.context_tokens} tokens; bandwidth: {bandwidth.method}")
    return Roofline(tok_s=tok_s, step_bytes=total, context_tokens=step.context_tokens,
                    bandwidth_bytes_per_s=bandwidth.bytes_per_s, roofline_tok_s=bandwidth.bytes_per_s / total,
                    achieved_bytes_per_s=tok_s * total, fraction=tok_s * total / bandwidth.bytes_per_s,
                    device=bandwidth.device, method=method)


def single_stream_roofline(tok_s: float | None, model_dir: str | Path | None, context_tokens: int, *,
                           bandwidth: Bandwidth | None = None) -> Roofline | None:
    """The roofline figure of a single-stream decode rate for the build in model_dir (a local folder) at
    context_tokens; None when there is no rate or the build is not a local folder with a config.json.
    bandwidth defaults to device_bandwidth() (NVML, else a measured CPU copy)."""
    if not tok_s or model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return None
    step = decode_step_bytes(model_dir, context_tokens)
    return roofline(tok_s, step, bandwidth or device_bandwidth())


SPECULATIVE_NOTE = "a drafter's steps read two models and emit several tokens: no single-model roofline"


def roofline_or_reason(tok_s: float, model_root: str | None, context_tokens: int) -> tuple[Roofline | None, str | None]:
    """single_stream_roofline for a measured run, or why there is none: an unreadable header or config must not
    cost the run its other figures."""
    try:
        fig = single_stream_roofline(tok_s, model_root, context_tokens)
    except Exception as exc:
        return None, f"the bytes per step of {model_root!r} could not be read: {exc}"
    if fig is None:
        return None, (f"the served model {model_root!r} is not a local folder with a config.json: its bytes per "
                      "step are unknown")
    return fig, None


def sweep_context(input_len: int, output_len: int) -> int:
    """A sweep cell's mean context over its decode: the prompt plus half the output."""
    return input_len + output_len // 2


def sweep_cell_roofline(output_tok_s: float | None, model_dir: str | Path | None, *, input_len: int,
                        output_len: int, bandwidth: Bandwidth | None = None) -> Roofline | None:
    """For a sweep's c=1 cell: the context is the prompt plus half the output (the mean over the decode).
    Pass the decode rate (1000 / mean TPOT ms) where the cell has it: output tok/s over the whole request
    includes the prefill."""
    return single_stream_roofline(output_tok_s, model_dir, sweep_context(input_len, output_len), bandwidth=bandwidth)
