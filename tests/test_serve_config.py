"""tpu.env, the environment and overrides; the server command line on each platform."""

from __future__ import annotations

import json

import pytest

from tools.serving.config import DEFAULT_ENV_FILE, load_config, parse_env_file
from tools.errors import ToolFailure


def test_committed_tpu_env_has_the_t4_flags(monkeypatch):
    for name in ("MODEL_NAME", "PORT", "HOST", "DTYPE", "STATE_DIR", "EXTRA_ARGS", "SPECULATIVE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config()
    assert cfg.env_file == DEFAULT_ENV_FILE.resolve()
    assert (cfg.host, cfg.port, cfg.base_url) == ("127.0.0.1", 8000, "http://127.0.0.1:8000")
    argv = cfg.vllm_argv("cuda")
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(argv)
    for flag in ("--dtype float16", "--gpu-memory-utilization 0.9", "--max-model-len 16384", "--max-num-seqs 8",
                 "--kv-cache-dtype auto", "--language-model-only", f"--model {cfg.model}"):
        assert flag in joined
    assert "--speculative-config" not in argv  # the drafter is off by default
    assert cfg.state_dir == (DEFAULT_ENV_FILE.parent / "run").resolve()


def test_cpu_argv_differs_only_in_dtype_and_gpu_memory(tmp_path):
    cfg = load_config(DEFAULT_ENV_FILE, model="m", served_name="s", port=1234, extra_args="--enforce-eager")
    cuda, cpu = cfg.vllm_argv("cuda"), cfg.vllm_argv("cpu")
    assert cpu[cpu.index("--dtype") + 1] == cfg.cpu_dtype == "bfloat16"
    assert "--gpu-memory-utilization" not in cpu
    strip = lambda a: [x for i, x in enumerate(a) if x not in ("--dtype", "--gpu-memory-utilization")
                       and a[i - 1] not in ("--dtype", "--gpu-memory-utilization")]
    assert strip(cuda) == strip(cpu)
    assert cpu[-1] == "--enforce-eager"
    assert cfg.server_env("cpu")["VLLM_CPU_KVCACHE_SPACE"] == str(cfg.cpu_kvcache_space_gib)
    assert "VLLM_CPU_KVCACHE_SPACE" not in cfg.server_env("cuda")


def test_precedence_file_env_override(tmp_path, monkeypatch):
    env = tmp_path / "tpu.env"
    env.write_text('# comment\nMODEL_NAME="org/model"\nPORT=8100\nexport MAX_NUM_SEQS=4\nSTATE_DIR=state\n'
                   'SPECULATIVE_CONFIG={"model": "d", "num_speculative_tokens": 3}\nEXTRA_ARGS=--a "b c"\n')
    monkeypatch.delenv("MODEL_NAME", raising=False)
    monkeypatch.setenv("PORT", "8200")
    cfg = load_config(env)
    assert cfg.model == "org/model" and cfg.served_name == "org/model"
    assert cfg.port == 8200 and cfg.max_num_seqs == 4
    assert cfg.state_dir == (tmp_path / "state").resolve()
    assert cfg.extra_args == ["--a", "b c"]
    argv = cfg.vllm_argv("cuda")
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 3
    cfg = load_config(env, port=8300, model=None)  # None: option not given
    assert cfg.port == 8300 and cfg.model == "org/model"


def test_local_model_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.delenv("MODEL_NAME", raising=False)
    (tmp_path / "ckpt").mkdir()
    env = tmp_path / "tpu.env"
    env.write_text("MODEL_NAME=ckpt\n")
    assert load_config(env).model == str((tmp_path / "ckpt").resolve())


@pytest.mark.parametrize("line, needle", [
    ("PORT=eighty", "PORT='eighty' is invalid"),
    ("PORT=70000", "PORT=70000 is not a TCP port"),
    ("LANGUAGE_MODEL_ONLY=maybe", "LANGUAGE_MODEL_ONLY='maybe' is invalid"),
    ("SPECULATIVE_CONFIG={not json", "SPECULATIVE_CONFIG"),
    ("GPU_MEMORY_UTILIZATION=1.5", "GPU_MEMORY_UTILIZATION=1.5"),
    ("this is not an assignment", "expected NAME=value"),
])
def test_bad_values_name_the_option(tmp_path, monkeypatch, line, needle):
    for name in ("PORT", "LANGUAGE_MODEL_ONLY", "SPECULATIVE_CONFIG", "GPU_MEMORY_UTILIZATION", "MODEL_NAME"):
        monkeypatch.delenv(name, raising=False)
    env = tmp_path / "tpu.env"
    env.write_text(f"MODEL_NAME=m\n{line}\n")
    with pytest.raises(ToolFailure) as exc:
        load_config(env)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_missing_file_and_unknown_override(tmp_path):
    with pytest.raises(ToolFailure, match="not found"):
        load_config(tmp_path / "nope.env")
    with pytest.raises(ToolFailure, match="unknown configuration field"):
        load_config(DEFAULT_ENV_FILE, colour="blue")


def test_every_tpu_env_name_is_read():
    from tools.serving.config import ENV_NAMES

    names = set(parse_env_file(DEFAULT_ENV_FILE))
    assert set(ENV_NAMES.values()) == names, "tpu.env and tools.serving.config.ENV_NAMES must list the same variables"
