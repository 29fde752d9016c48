"""Parameter models of the serving operations: `./vllm-t4 start|stop|query|log` flags and the MCP tools'
arguments are derived from these. The results are tools.serving.vllm_server's StartResult, StopResult,
ServerStatus and QueryResult."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tools.params import OpParams


class StartParams(OpParams):
    model: str | None = Field(None, description="Checkpoint folder or hub id for this start; default: MODEL_NAME "
                                                "of the serving config (tpu.env)")
    served_name: str | None = Field(None, description="Name clients send as model; default: SERVED_MODEL_NAME")
    port: int | None = Field(None, ge=1, le=65535, description="Port for this start; default: PORT")
    max_model_len: int | None = Field(None, ge=16, description="Context length for this start; default: "
                                                                "MAX_MODEL_LEN (small models need less)")
    max_num_seqs: int | None = Field(None, ge=1, description="Concurrent sequences; default: MAX_NUM_SEQS")

    def overrides(self) -> dict[str, Any]:
        """The serving-config overrides this start asks for (unset fields keep tpu.env's values)."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class StopParams(OpParams):
    CLI_FLAGS = {"grace_s": "--grace"}

    grace_s: float = Field(20.0, ge=0, le=300, description="Seconds between SIGTERM and SIGKILL")


class QueryParams(OpParams):
    CLI_POSITIONAL = ("prompt",)

    prompt: str = Field(min_length=1, description="User message (chat template applied)")
    max_tokens: int = Field(64, ge=1, le=4096, description="Tokens to generate at most")


class LogParams(OpParams):
    CLI_FLAGS = {"lines": ("-n", "--lines")}

    lines: int = Field(50, ge=1, le=2000, description="How many last lines")
