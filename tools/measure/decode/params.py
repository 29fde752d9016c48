"""What a decode run is asked (DecodeParams: the `./vllm-t4 decode` flags and run_decode_bench's arguments) and what
it reads and sends besides its prompts: the checkpoint's sampling (a generation_config.json read through one
model, so a damaged file is one line naming it and the field) and the request errors of the HTTP client as one
line naming the timeout that caused them."""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Iterator, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from tools.core.errors import BadInput, ToolFailure, op, param
from tools.core.json_files import check_json, read_json
from tools.core.params import OpParams, Seconds, Seed
from tools.measure.sweep.params import DEFAULT_OUT
from tools.measure.endpoint import EndpointParams


class DecodeRequests(OpParams):
    """What every decode run sends: the shipped prompts, the output length, the seeds."""

    prompts: int = Field(20, ge=1, le=20, description="How many of the twenty shipped prompts to send")
    max_tokens: int = Field(256, ge=2, le=1_000_000, description="Output tokens per request at most")
    seed: Seed = Field(0, description="Sampling seed of prompt i is seed + i (checkpoint sampling)")
    request_timeout_s: Seconds = Field(600.0, description="Seconds per request before the run fails")


class DecodeParams(DecodeRequests, EndpointParams):
    """Options of one decode benchmark: `./vllm-t4 decode` flags and the run_decode_bench MCP arguments."""

    CLI_BAD_INPUT: ClassVar[type[Exception] | None] = BadInput
    MCP_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"model", "request_timeout_s", "generation_config"})
    MCP_DEFAULTS: ClassVar[dict[str, Any]] = {"out": "."}

    sampling: Literal["greedy", "checkpoint"] = Field(
        "greedy", description="greedy (temperature 0) or the checkpoint's generation_config.json (temperature, "
                              "top_k, top_p)")
    label: str = Field("decode", description="Name of this setting for tables and the run id (no spaces)")
    out: Path = Field(DEFAULT_OUT, description="Folder that receives the run folder (through MCP: under an "
                                               "evidence root, default the first)")
    generation_config: str | None = Field(None, description="generation_config.json to read for --sampling "
                                                            "checkpoint (default: the served model folder's)")
    model: str | None = Field(None, description="Served model name; default: the first of /v1/models")


class GenerationConfig(BaseModel):
    """The sampling fields of a generation_config.json (the rest of the file is not ours to check)."""

    model_config = ConfigDict(extra="ignore")

    temperature: float = Field(1.0, ge=0)   # the transformers default
    top_k: StrictInt | None = Field(None, ge=-1)  # 1.5 is no top-k: refused, never truncated
    top_p: float | None = Field(None, gt=0, le=1)

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v


def checkpoint_sampling(path: str | Path) -> dict[str, Any]:
    """temperature, top_k, top_p from a generation_config.json (the fields it has)."""
    p = Path(path)
    if not p.exists():
        raise BadInput(f"{p}: no generation_config.json for {param('sampling', 'checkpoint')}; pass "
                       f"{param('generation_config')} PATH or use {param('sampling', 'greedy')}",
                       detail={"path": str(p)}, field="generation_config")
    remedy = f"fix the file or pass {param('generation_config')} PATH"
    cfg = check_json(p, read_json(p, remedy=remedy, field="generation_config"), GenerationConfig, remedy=remedy,
                     field="generation_config")
    return cfg.model_dump(exclude_none=True)


@contextmanager
def request_errors(base_url: str, timeout_s: float) -> Iterator[None]:
    """A request that timed out or lost its connection as one line (the server, the timeout, what to do)."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise ToolFailure(f"a request to {base_url} got no answer within {timeout_s:g} s "
                          f"({type(exc).__name__}); give {param('request_timeout_s')} more seconds or check the "
                          f"server's log", detail={"timeout_s": timeout_s}, field="request_timeout_s") from None
    except httpx.TransportError as exc:
        raise ToolFailure(f"the server at {base_url} dropped a request ({type(exc).__name__}: {exc}); check it "
                          f"with {op('status')}", detail={"error": type(exc).__name__}) from None


__all__ = ["GenerationConfig", "checkpoint_sampling", "request_errors"]
