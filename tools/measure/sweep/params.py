"""What a sweep is asked and what it returns: the parameter and result models, shared by the sweep runner
(tools/measure/sweep/run.py), its evidence files and comparisons (tools/measure/sweep/report.py), the command line
and the MCP server. Kept apart so that neither of the two modules has to import the other.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from tools.core.errors import BadInput, param
from tools.core.names import check_name
from tools.core.text import clip
from tools.core.params import Price, Seconds, Seed
from tools.measure.endpoint import EndpointParams
from tools.core.root import PROJECT_ROOT
from tools.measure.roofline import Roofline
from tools.measure.uncertainty import Estimate, estimate

DEFAULT_OUT = PROJECT_ROOT / "evidence"
Tokens = Annotated[int, Field(ge=1, le=10_000_000)]  # a prompt or output length

DEFAULT_PRICE_PER_HOUR = 0.5241  # the article's n1-standard-2 + T4 VM, us-west2 on-demand
PREFIX_CACHE_POLICY = ("prefix caching left as served; every measured repeat uses prompts from its own seed "
                       "(derived from base seed, input length, concurrency, repeat) and the warm-up uses "
                       "separate seeds, so no measured prompt was sent before; hits are read from /metrics")

# Per-repeat metrics kept from vLLM's result JSON, in table order.
METRICS: tuple[str, ...] = (
    "output_throughput", "request_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms",
    "p50_ttft_ms", "p50_tpot_ms", "p50_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "p50_e2el_ms", "p90_e2el_ms", "p99_e2el_ms",
    "request_goodput", "max_concurrent_requests", "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
)


class SweepParams(EndpointParams):
    """Options of one sweep: `./vllm-t4 sweep` flags and the run_sweep MCP arguments are derived from these."""

    CLI_FLAGS: ClassVar[dict[str, str]] = {"concurrencies": "--concurrency", "cell_timeout_s": "--cell-timeout"}
    MCP_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"run_id", "tokenizer", "model", "cell_timeout_s"})
    MCP_DEFAULTS: ClassVar[dict[str, Any]] = {"out": "."}  # the first evidence root

    input_lens: list[Tokens] = Field(default_factory=lambda: [512, 4096], min_length=1,
                                     description="Prompt lengths in tokens")
    output_len: Tokens = Field(128, description="Output tokens per request (ignore_eos)")
    concurrencies: list[Annotated[int, Field(ge=1, le=100_000)]] = Field(
        default_factory=lambda: [1, 4, 8, 16], min_length=1, description="Concurrent requests per cell")
    repeats: int = Field(3, ge=1, le=1000, description="Repeats per cell (medians reported)")
    prompts_per_concurrency: int = Field(4, ge=1, le=10_000, description="Prompts per cell = max(min_prompts, "
                                                                         "concurrency x this)")
    min_prompts: int = Field(4, ge=1, le=1_000_000, description="Fewest prompts per cell")
    label: str = Field("build", description="Build name for tables and the run id")
    price_per_hour: Price = Field(DEFAULT_PRICE_PER_HOUR, description="Machine $/hour (default: the "
                                                                      "article's T4 VM)")
    out: Path = Field(DEFAULT_OUT, description="Where the run folder goes (MCP: under an "
                                               "evidence root)")
    resume: bool = Field(False, description="Continue the latest matching run, skipping finished repeats")
    run_id: str | None = Field(None, description="Exact run folder name inside out (resumes it if present)")
    seed: Seed = Field(0, description="Prompt seed: equal across builds")
    tokenizer: str | None = Field(None, description="Tokenizer folder; default: the folder the server loaded")
    model: str | None = Field(None, description="Served model name; default: the first of /v1/models")
    warmup: bool = Field(True, description="Warm each cell with separate-seed prompts first")
    cell_timeout_s: Seconds = Field(3600.0, description="Seconds per repeat before a cell is stopped (more than 0, "
                                                      "at most a week)")

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, concurrency * self.prompts_per_concurrency)

    def validate(self) -> None:
        def positive(name: str, values: list[int]) -> None:
            if not values or any(int(v) <= 0 for v in values):
                raise BadInput(f"{param(name)} must be a non-empty list of positive integers, got {clip(values)}",
                               field=name)

        positive("input_lens", self.input_lens)
        positive("concurrencies", self.concurrencies)
        positive("output_len", [self.output_len])
        positive("repeats", [self.repeats])
        positive("prompts_per_concurrency", [self.prompts_per_concurrency])
        positive("min_prompts", [self.min_prompts])
        if not self.price_per_hour >= 0 or self.price_per_hour == float("inf"):
            raise BadInput(f"{param('price_per_hour')} must be a finite number >= 0, got {self.price_per_hour}",
                           field="price_per_hour")
        check_name(self.label)  # it names the run folder

    def identity(self) -> dict[str, Any]:
        """What makes two runs the same measurement (for resume): not the label, URL or output folder."""
        return {"input_lens": list(self.input_lens), "output_len": self.output_len,
                "concurrencies": list(self.concurrencies), "repeats": self.repeats,
                "prompts_per_concurrency": self.prompts_per_concurrency, "min_prompts": self.min_prompts,
                "seed": self.seed, "warmup": self.warmup}



def cell_stem(input_len: int, concurrency: int, request_rate: float | None = None) -> str:
    """A cell's name in the run's raw/ folder: L<in>-c<concurrency>, or L<in>-q<rate> where a rate sets the load."""
    load = f"c{concurrency}" if request_rate is None else f"q{request_rate:g}"
    return f"L{input_len}-{load}"


def raw_name(input_len: int, concurrency: int, repeat: int, request_rate: float | None = None) -> str:
    """A repeat's record in raw/."""
    return f"{cell_stem(input_len, concurrency, request_rate)}-r{repeat}.json"


class CellSpec(BaseModel):
    """One cell as the benchmark worker (tools/measure/sweep/worker.py) receives it: a JSON line on its stdin,
    and the "spec" in each raw repeat record and raw/<stem>.spec.json. Built by `cells.cell_spec` only."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str
    model: str
    tokenizer: str
    input_len: int = Field(ge=1)
    output_len: int = Field(ge=1)
    concurrency: int = Field(ge=0, description="vLLM's --max-concurrency; 0 where request_rate sets the load")
    request_rate: float | None = Field(None, gt=0, description="Poisson requests per second, or None")
    goodput: dict[str, float] | None = Field(None, description="vLLM's --goodput limits in ms (ttft, tpot, e2el)")
    num_prompts: int = Field(ge=1)
    repeats: tuple[int, ...] = Field(description="The repeats to measure, in order")
    seeds: dict[int, int] = Field(description="Each repeat's prompt seed")
    warmup_seed: int | None = Field(description="The warm-up's prompt seed; None: no warm-up")
    warmup_prompts: int = Field(ge=1, description="Requests in the warm-up")
    raw_dir: str
    log_file: str = Field(description="Where vLLM's benchmark output for the cell goes")

    @property
    def stem(self) -> str:
        return cell_stem(self.input_len, self.concurrency, self.request_rate)

    def raw_file(self, repeat: int) -> str:
        return raw_name(self.input_len, self.concurrency, repeat, self.request_rate)


class RepeatResult(BaseModel):
    repeat: int
    seed: int
    status: Literal["ok", "failed"]
    reason: str | None = None
    num_prompts: int
    metrics: dict[str, float | None] = Field(default_factory=dict)
    prefix_cache_queries: float | None = Field(None, description="Prompt tokens looked up in the prefix cache")
    prefix_cache_hits: float | None = Field(None, description="Prompt tokens served from the prefix cache")
    spec_decode: dict[str, Any] | None = Field(None, description="Speculative decoding during the repeat, from "
                                                                 "/metrics deltas: drafts, draft_tokens, "
                                                                 "accepted_tokens, acceptance_rate, per_position")
    warmup_s: float | None = None
    measure_s: float | None = Field(None, description="Wall time of vLLM's benchmark call for this repeat")
    raw_file: str | None = None


# The metrics a cell gives as the geometric mean of its repeats with a 95% interval (tools/measure/uncertainty.py), in
# summary.md's table, run_sweep's result and summary, the plot and compare_sweeps; every other metric is the median.
GEOMEAN_METRICS: tuple[str, ...] = ("output_throughput", "p99_ttft_ms", "mean_tpot_ms")


class CellResult(BaseModel):
    input_len: int
    output_len: int
    concurrency: int = Field(description="Concurrent requests (vLLM's --max-concurrency); 0 where request_rate "
                                         "sets the load")
    request_rate: float | None = Field(None, description="Poisson requests per second (vLLM's --request-rate), "
                                                         "where that sets the load")
    num_prompts: int
    status: Literal["ok", "infeasible", "failed"]
    reason: str | None = None
    repeats: list[RepeatResult] = Field(default_factory=list)
    median: dict[str, float | None] = Field(default_factory=dict, description="Median over ok repeats")
    spread_pct: dict[str, float | None] = Field(default_factory=dict,
                                                description="(max - min) / median x 100 over ok repeats")
    wall_s: float | None = Field(None, description="Wall time of the cell's subprocess (warm-up included)")
    acceptance_rate: float | None = Field(None, description="Accepted / draft tokens over the ok repeats (none "
                                                            "without speculative decoding)")

    @property
    def key(self) -> tuple[int, float]:
        return self.input_len, self.concurrency if self.request_rate is None else self.request_rate

    @property
    def load(self) -> float:
        """The cell's load: its concurrency, or its request rate."""
        return self.concurrency if self.request_rate is None else self.request_rate

    def estimate(self, metric: str = "output_throughput") -> Estimate:
        """The metric over the ok repeats: geometric mean and 95% interval (tools/measure/uncertainty.py); the
        recorded median stands in for a cell without repeats (published figures)."""
        if self.status != "ok":
            return Estimate(n=0, mean=None)
        return estimate((r.metrics.get(metric) for r in self.repeats if r.status == "ok"), self.median.get(metric))

    def figure(self, metric: str) -> float | None:
        """The cell's one figure for a metric, as every result, summary and file gives it: the geometric mean of
        the repeats for GEOMEAN_METRICS, the median for the others."""
        return self.estimate(metric).mean if metric in GEOMEAN_METRICS else self.median.get(metric)

    @computed_field(description="Output tok/s over the ok repeats: geometric mean and 95% interval")
    @property
    def output_throughput_ci(self) -> Estimate:
        return self.estimate("output_throughput")


class SweepResult(BaseModel):
    run_id: str
    run_dir: str
    label: str
    params: dict[str, Any]
    prefix_cache_policy: str = PREFIX_CACHE_POLICY
    max_model_len: int | None = None
    model: str | None = None
    started: str
    finished: str | None = None
    wall_s: float | None = None
    cells: list[CellResult] = Field(default_factory=list)
    provenance: dict[str, Any] = Field(default_factory=dict)
    speculative_config: dict[str, Any] | None = None  # the server's --speculative-config
    # Per input length, the c=1 cell's decode rate (1000 / mean TPOT) as a share of the memory-bandwidth roofline
    # (tools/measure/roofline.py); roofline_note: why a c=1 cell has none, where one has none
    roofline: dict[int, Roofline] = Field(default_factory=dict)
    roofline_note: str | None = None
    files: dict[str, str] = Field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @property
    def counts(self) -> dict[str, int]:
        out = {"ok": 0, "infeasible": 0, "failed": 0}
        for c in self.cells:
            out[c.status] += 1
        return out

    def cell(self, input_len: int, concurrency: int) -> CellResult | None:
        return next((c for c in self.cells if c.key == (input_len, concurrency)), None)


def cell_acceptance(repeats: list[RepeatResult]) -> float | None:
    """Accepted / draft tokens summed over the ok repeats that recorded speculative decoding."""
    specs = [r.spec_decode for r in repeats if r.status == "ok" and r.spec_decode]
    drafted = sum(float(s.get("draft_tokens") or 0) for s in specs)
    return sum(float(s.get("accepted_tokens") or 0) for s in specs) / drafted if drafted else None


def aggregate(repeats: list[RepeatResult]) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """Median and spread (max-min)/median in percent of every metric over the ok repeats."""
    ok = [r for r in repeats if r.status == "ok"]
    median: dict[str, float | None] = {}
    spread: dict[str, float | None] = {}
    for m in METRICS:
        vals = [float(r.metrics[m]) for r in ok if r.metrics.get(m) is not None]
        if not vals:
            median[m] = spread[m] = None
            continue
        med = statistics.median(vals)
        median[m] = med
        spread[m] = (max(vals) - min(vals)) / med * 100.0 if med else None
    return median, spread
