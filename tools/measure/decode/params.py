"""What a decode run reads and sends besides its prompts: the checkpoint's sampling (a generation_config.json read
through one model, so a damaged file is one line naming it and the field) and the request errors of the HTTP
client as one line naming the timeout that caused them."""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from tools.core.errors import BadInput, ToolFailure, op, param
from tools.core.json_files import check_json, read_json


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
