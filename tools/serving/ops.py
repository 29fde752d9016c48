"""Parameter models of the serving operations: `./vllm-t4 start|stop|status|query|log|router` flags and the MCP
tools' arguments are derived from these. The results are tools.serving.server.server's StartResult, StopResult,
ServerStatus and QueryResult, and tools.serving.frontdoor.router's."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from tools.core.params import Name, OpParams


INSTANCE_HELP = "Named instance (none: the default one)"


class InstanceParams(OpParams):
    """The instance an operation acts on."""


    instance: str | None = Field(None, description=INSTANCE_HELP)


class StartParams(InstanceParams):
    MCP_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"cpus"})  # a machine-local knob

    model: str | None = Field(None, description="Checkpoint folder or hub id (default: MODEL_NAME)")
    served_name: Name | None = Field(None, description="Name clients send as model (default: SERVED_MODEL_NAME, "
                                                            "or where empty the model's folder name)")
    port: int | None = Field(None, ge=1, le=65535, description="Port (default: PORT)")
    max_model_len: int | None = Field(None, ge=16, description="Context length (default: MAX_MODEL_LEN)")
    max_num_seqs: int | None = Field(None, ge=1, description="Concurrent sequences (default: MAX_NUM_SEQS)")
    gpus: list[int] | None = Field(None, description="GPU indices (default: the first TP x DP)")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="Share of its GPUs' memory "
                                                 "(two on one card: 0.45 each)")
    cpus: int | None = Field(None, ge=1, description="CPU backend: cores bound to this instance; default: an even "
                                                     "share of the free cores (none bound for a lone default "
                                                     "instance)")

    replace: bool = Field(False, description="In place of the running build; it serves again if this fails")
    new_key: bool | None = Field(None, description="Allow a new VLLM_API_KEY")

    def overrides(self) -> dict[str, Any]:
        """The serving-config overrides this start asks for (unset fields keep tpu.env's values)."""
        return {k: v for k, v in self.model_dump(exclude={"replace", "new_key"}).items() if v is not None}


class StopParams(InstanceParams):
    CLI_FLAGS = {"grace_s": "--grace"}

    grace_s: float = Field(20.0, ge=0, le=300, description="Seconds between SIGTERM and SIGKILL")
    all: bool = Field(False, description="Stop the router and every instance")


class StatusParams(InstanceParams):
    pass


class QueryParams(InstanceParams):
    CLI_POSITIONAL = ("prompt",)
    MULTILINE: ClassVar[frozenset[str]] = frozenset({"prompt"})

    prompt: str = Field(min_length=1, description="User message (chat template applied)")
    max_tokens: int = Field(64, ge=1, le=4096, description="Tokens to generate at most")


class LogParams(InstanceParams):
    CLI_FLAGS = {"lines": ("-n", "--lines")}

    lines: int = Field(50, ge=1, le=2000, description="How many last lines")


class RouterStartParams(OpParams):
    CLI_COMMA: ClassVar[frozenset[str]] = frozenset({"instances"})

    instances: list[str] = Field(min_length=1, description="Running instances to route to, comma separated "
                                                           "(default names the default instance)")
    policy: Literal["round_robin", "cache_aware", "power_of_two", "random", "consistent_hash", "kv_aware",
                    "sticky_least_loaded"] = Field("round_robin", description="vllm-router's load-balancing policy")
    port: int = Field(8100, ge=1, le=65535, description="Port the router listens on")
    hold_s: float = Field(180.0, ge=0, le=3600, description="Seconds a request is held and retried while no "
                                                            "instance behind the router answers (a switch)")


class RouterSwitchParams(OpParams):
    MCP_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"cpus"})  # a machine-local knob

    instance: str = Field(min_length=1, description="Named instance the new build starts as, behind the router "
                                                    "(not the one serving)")
    model: str = Field(min_length=1, description="Checkpoint folder or hub id of the new build")
    served_name: str | None = Field(None, description="Name it serves as (default: SERVED_MODEL_NAME, or where "
                                                      "empty the model's folder name)")
    from_instance: str | None = Field(None, description="The instance it replaces (default: the router's only one)")
    port: int | None = Field(None, ge=1, le=65535, description="Its internal port (default: a free one)")
    max_model_len: int | None = Field(None, ge=16, description="Context length (default: MAX_MODEL_LEN)")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="Share of its GPU's memory")
    cpus: int | None = Field(None, ge=1, description="CPU backend: cores bound to it (default: an even share of "
                                                     "the free ones)")

    def overrides(self) -> dict[str, Any]:
        """The new build's instance config overrides (unset fields keep tpu.env's values)."""
        return {k: v for k, v in self.model_dump(exclude={"from_instance"}).items() if v is not None}


class RouterStopParams(OpParams):
    CLI_FLAGS = {"grace_s": "--grace"}

    grace_s: float = Field(10.0, ge=0, le=300, description="Seconds between SIGTERM and SIGKILL")
