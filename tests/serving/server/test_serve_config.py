"""tpu.env, the environment and overrides; the server command line on each platform."""

from __future__ import annotations

import json

import pytest

from tests.helpers.fixtures import IN_PROCESS_TORCH
from tools.serving.config import DEFAULT_ENV_FILE, load_config, parse_env_file
from tools.core.commands import CLI
from tools.core.errors import ToolFailure


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


def test_cpu_starts_eager_unless_cpu_compile(monkeypatch):
    monkeypatch.delenv("CPU_COMPILE", raising=False)
    cfg = load_config(DEFAULT_ENV_FILE, model="m", served_name="s", port=1234)
    assert cfg.cpu_compile is False
    assert "--enforce-eager" in cfg.vllm_argv("cpu")
    assert "--enforce-eager" not in cfg.vllm_argv("cuda")  # the T4 path always compiles
    monkeypatch.setenv("CPU_COMPILE", "1")
    cfg = load_config(DEFAULT_ENV_FILE, model="m", served_name="s", port=1234)
    assert "--enforce-eager" not in cfg.vllm_argv("cpu")


def test_cpu_argv_differs_only_in_dtype_and_gpu_memory(tmp_path):
    cfg = load_config(DEFAULT_ENV_FILE, model="m", served_name="s", port=1234, extra_args="--enforce-eager",
                      cpu_compile=True)
    cuda, cpu = cfg.vllm_argv("cuda"), cfg.vllm_argv("cpu")
    assert cpu[cpu.index("--dtype") + 1] == cfg.cpu_dtype == "float16"  # the T4's dtype on the CPU too
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
    ("PORT=eighty", "PORT='eighty', set in"),
    ("PORT=70000", "is not a TCP port"),
    ("LANGUAGE_MODEL_ONLY=maybe", "LANGUAGE_MODEL_ONLY='maybe', set in"),
    ("SPECULATIVE_CONFIG={not json", "SPECULATIVE_CONFIG"),
    ("GPU_MEMORY_UTILIZATION=1.5", "GPU_MEMORY_UTILIZATION=1.5"),
    ("this is not an assignment", "not a NAME=value line"),
])
def test_bad_values_name_the_option(tmp_path, monkeypatch, line, needle):
    for name in ("PORT", "LANGUAGE_MODEL_ONLY", "SPECULATIVE_CONFIG", "GPU_MEMORY_UTILIZATION", "MODEL_NAME"):
        monkeypatch.delenv(name, raising=False)
    env = tmp_path / "tpu.env"
    env.write_text(f"MODEL_NAME=m\n{line}\n")
    with pytest.raises(ToolFailure) as exc:
        load_config(env)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("name, value", [("FRONT_DOOR_HOLD_S", "nan"), ("START_TIMEOUT_S", "-1"),
                                         ("PORT", "70000"), ("GPU_MEMORY_UTILIZATION", "1.5"),
                                         ("MAX_NUM_SEQS", "0"), ("PORT", "eighty")])
def test_a_bad_value_is_blamed_on_where_it_was_set(tmp_path, monkeypatch, name, value):
    """Set in the environment, the value is the environment's to fix, not tpu.env's (which was blamed for
    FRONT_DOOR_HOLD_S=nan); set in the file, the file is named; either way bad input (exit 2)."""
    from tools.core.errors import BadInput

    env = tmp_path / "tpu.env"
    env.write_text("MODEL_NAME=m\n")
    monkeypatch.setenv(name, value)
    with pytest.raises(BadInput) as exc:
        load_config(env)
    said = str(exc.value)
    assert said.startswith(f"{name}=") and value in said.split(",")[0], said
    assert "set in the environment" in said and str(env) not in said and "\n" not in said
    monkeypatch.delenv(name)
    env.write_text(f"MODEL_NAME=m\n{name}={value}\n")
    with pytest.raises(BadInput) as exc:
        load_config(env)
    assert f"set in {env}" in str(exc.value) and "environment" not in str(exc.value), str(exc.value)


@pytest.mark.parametrize("first", ["root:$6$SECRETHASH:20228:0:99999:7:::", "SECRET_LINE", "export =SECRET"])
def test_a_file_that_is_not_an_env_file_is_never_echoed(tmp_path, first):
    """--env-file /etc/shadow printed the file's first line in its error: a file that is not an env file is
    named, with its line number, and none of its content is repeated."""
    from tools.core.errors import BadInput

    f = tmp_path / "shadow"
    f.write_text(f"{first}\nMODEL_NAME=m\n")
    with pytest.raises(BadInput) as exc:
        load_config(f)
    said = str(exc.value)
    assert f"{f}:1" in said and "SECRET" not in said and "NAME=value" in said and "\n" not in said, said


def test_missing_file_and_unknown_override(tmp_path):
    from tools.core.errors import BadInput

    with pytest.raises(BadInput, match="does not exist; pass an existing tpu.env") as exc:
        load_config(tmp_path / "nope.env")
    assert exc.value.field == "env_file" and str(tmp_path / "nope.env") in str(exc.value)
    with pytest.raises(ToolFailure, match="unknown configuration field"):
        load_config(DEFAULT_ENV_FILE, colour="blue")


def test_every_tpu_env_name_is_read():
    from tools.serving.config import ENV_NAMES

    names = set(parse_env_file(DEFAULT_ENV_FILE))
    assert set(ENV_NAMES.values()) == names, "tpu.env and tools.serving.config.ENV_NAMES must list the same variables"


def test_default_model_is_this_projects_local_build(monkeypatch):
    monkeypatch.delenv("MODEL_NAME", raising=False)
    monkeypatch.delenv("SERVED_MODEL_NAME", raising=False)
    cfg = load_config()
    build = (DEFAULT_ENV_FILE.parent / "models" / "gemma-4-E2B-it-qat-q4_0-w4a16-ct-text-emb4").resolve()
    assert cfg.model == str(build)  # a folder under models/, not someone else's hub upload
    assert cfg.served_name == build.name


def test_missing_local_build_is_refused_before_launching(tmp_path, monkeypatch):
    from tools.serving.server.server import start_server

    for name in ("MODEL_NAME", "PORT", "STATE_DIR"):
        monkeypatch.delenv(name, raising=False)
    env = tmp_path / "tpu.env"
    env.write_text("MODEL_NAME=./models/not-built-yet\nSTATE_DIR=state\nPORT=1\n")
    cfg = load_config(env)
    assert cfg.model == str((tmp_path / "models" / "not-built-yet").resolve())
    with pytest.raises(ToolFailure) as exc:
        start_server(cfg)
    msg = exc.value.render(CLI)
    assert "does not exist" in msg and "./vllm-t4 demo" in msg and "python3 -m repack build" in msg
    assert "\n" not in msg
    assert not list((tmp_path / "state").glob("vllm*.log"))  # nothing launched


def _model_with_limit(tmp_path, limit: int, nested: bool):
    model = tmp_path / "short-model"
    model.mkdir()
    body = {"max_position_embeddings": limit}
    cfg = {"text_config": body} if nested else body
    (model / "config.json").write_text(json.dumps(cfg))
    return model


@pytest.mark.parametrize("nested", [False, True])
def test_max_model_len_from_tpu_env_is_fitted_to_the_model(tmp_path, monkeypatch, nested):
    from tools.serving.server.launch import fit_to_model

    monkeypatch.delenv("MAX_MODEL_LEN", raising=False)
    model = _model_with_limit(tmp_path, 2048, nested)
    cfg = load_config(DEFAULT_ENV_FILE, model=str(model), served_name="s")
    assert cfg.max_model_len == 16384 and not cfg.given_for_this_start("max_model_len")
    fitted, note = fit_to_model(cfg)
    assert fitted.max_model_len == 2048
    assert "--max-model-len 2048" in " ".join(fitted.vllm_argv("cpu"))
    assert "16384" in note and "2048" in note
    same, none = fit_to_model(load_config(DEFAULT_ENV_FILE, model=str(model), served_name="s", max_model_len=1024))
    assert same.max_model_len == 1024 and none is None


@pytest.mark.parametrize("how", ["override", "environment"])
def test_max_model_len_given_for_this_start_above_the_limit_is_refused(tmp_path, monkeypatch, how):
    from tools.serving.server.server import start_server

    model = _model_with_limit(tmp_path, 2048, nested=True)
    monkeypatch.delenv("MAX_MODEL_LEN", raising=False)
    if how == "environment":
        monkeypatch.setenv("MAX_MODEL_LEN", "4096")
        cfg = load_config(DEFAULT_ENV_FILE, model=str(model), served_name="s", state_dir=tmp_path / "st", port=1)
    else:
        cfg = load_config(DEFAULT_ENV_FILE, model=str(model), served_name="s", state_dir=tmp_path / "st", port=1,
                          max_model_len=4096)
    with pytest.raises(ToolFailure, match="above the model's own limit") as exc:
        start_server(cfg)
    assert "pass at most 2048" in str(exc.value) and exc.value.detail["model_limit"] == 2048
    assert not list((tmp_path / "st").glob("vllm*.log"))


def test_vllms_explaining_line_wins_over_the_pydantic_header():
    from tools.serving.server.engine_log import explain_failure

    log = """\
(APIServer pid=1) ERROR 11-29 10:00:00 [api_server.py:1] pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
(APIServer pid=1)   Value error, User-specified max_model_len (16384) is greater than the derived max_model_len (max_position_embeddings=2048.0 or model_max_length=None in model's config.json). [type=value_error, input_value=ArgsKwargs((), {}), input_type=ArgsKwargs]
(APIServer pid=1) RuntimeError: Engine core initialization failed. See root cause above.
"""
    why = explain_failure(log)
    assert why.startswith("Value error, User-specified max_model_len (16384)")


def _cli(env_file, *args, **environ):
    import os
    import subprocess
    import sys

    from tests.helpers.fixtures import ROOT

    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_NAME", "STATE_DIR", "PORT")}
    return subprocess.run([sys.executable, "-m", "tools.cli", *args, "--env-file", str(env_file)], cwd=ROOT,
                          env={**env, "PYTHONPATH": str(ROOT), **environ}, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("where", ["/etc", "/usr/lib", "/", "file", "others"])
def test_state_dir_must_be_a_folder_of_the_projects(tmp_path, where):
    """STATE_DIR=/etc in an env file once made status and stop read and write there: a system folder, a file and
    a folder with other files in it and none of the project's are refused in one line naming STATE_DIR and its
    source (exit 2); nothing is written there."""
    other = tmp_path / "others"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    target = {"file": tmp_path / "file", "others": other}.get(where, where)
    env = tmp_path / "tpu.env"
    env.write_text(f"MODEL_NAME=org/m\nSTATE_DIR={target}\nPORT=18777\n")
    for command in (["status"], ["stop"], ["start"]):
        r = _cli(env, *command)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        [line] = r.stderr.strip().splitlines()
        assert f"STATE_DIR={target}, set in {env}" in line, line
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    (tmp_path / "empty.env").write_text("MODEL_NAME=org/m\n")
    r = _cli(tmp_path / "empty.env", "status", STATE_DIR=str(target))
    assert r.returncode == 2 and f"STATE_DIR={target}, set in the environment" in r.stderr, r.stderr


def test_state_dir_new_empty_marked_or_the_projects_is_taken(tmp_path):
    from tools.serving.config import STATE_MARKER

    (tmp_path / "empty.env").write_text("")
    for d in ("new", "empty", "marked", "used", "switched"):
        if d != "new":
            (tmp_path / d).mkdir()
    (tmp_path / "switched" / "last_switch.json").write_text("{}")  # what a stopped front door leaves
    (tmp_path / "switched" / "logs").mkdir()
    (tmp_path / "switched" / "logs" / "b-20260101T000000Z.log").touch()
    (tmp_path / "marked" / STATE_MARKER).touch()
    (tmp_path / "marked" / "notes.txt").touch()
    (tmp_path / "used" / "blue").mkdir()
    (tmp_path / "used" / "blue" / "vllm-20260101T000000Z-1.log").touch()
    for d in ("new", "empty", "marked", "used", "switched"):
        cfg = load_config(tmp_path / "empty.env", model="org/m", state_dir=str(tmp_path / d))
        assert cfg.state_dir == tmp_path / d
    assert load_config(DEFAULT_ENV_FILE, model="org/m").state_dir == (DEFAULT_ENV_FILE.parent / "run").resolve()


@pytest.mark.parametrize("source", ["file", "environment"])
def test_an_empty_model_name_is_one_line_naming_it_and_its_source(tmp_path, source):
    env = tmp_path / "tpu.env"
    env.write_text("MODEL_NAME=\n" if source == "file" else "")
    extra = {"MODEL_NAME": ""} if source == "environment" else {}
    r = _cli(env, "status", STATE_DIR=str(tmp_path / "run"), **extra)
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "MODEL_NAME is empty" in line and (f"set in {env}" if source == "file" else "set in the environment") in line


@pytest.mark.parametrize("key, name", [("model", "MODEL_NAME"), ("state_dir", "STATE_DIR"),
                                       ("swapfile", "SWAPFILE"), ("source_checkpoint", "SOURCE_CHECKPOINT")])
def test_a_nul_byte_in_a_path_setting_is_one_line_naming_it(tmp_path, monkeypatch, key, name):
    """STATE_DIR=/tmp/atk/a<NUL>b in an env file made status end in `ValueError: embedded null byte` (exit 1); every
    path-valued setting, from the file or from the caller, is refused in one line naming it and where it was set."""
    from tools.core.errors import BadInput

    for n in ("MODEL_NAME", "STATE_DIR", "SWAPFILE", "SOURCE_CHECKPOINT"):
        monkeypatch.delenv(n, raising=False)
    env = tmp_path / "tpu.env"
    env.write_bytes(b"MODEL_NAME=org/m\nSTATE_DIR=run\n" + f"{name}={tmp_path}/a\x00b\n".encode())
    with pytest.raises(BadInput) as exc:
        load_config(env)
    said = str(exc.value)
    assert said.startswith(f"{name}=") and f"set in {env}" in said and "NUL byte" in said and "\n" not in said, said
    env.write_text("MODEL_NAME=org/m\nSTATE_DIR=run\n")
    with pytest.raises(BadInput) as exc:
        load_config(env, **{key: f"{tmp_path}/a\x00b"})
    assert str(exc.value).startswith(f"{name}=") and "given to this command" in str(exc.value), str(exc.value)


def test_a_nul_byte_in_state_dir_is_exit_2_at_the_command_line(tmp_path):
    env = tmp_path / "tpu.env"
    env.write_bytes(f"MODEL_NAME=org/m\nSTATE_DIR={tmp_path}/a\x00b\n".encode())
    r = _cli(env, "status")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert f"STATE_DIR={tmp_path}/a\\x00b, set in {env}" in line, line


@pytest.mark.parametrize("kind", ["folder", "device", "FIFO"])
def test_an_env_file_that_is_not_a_regular_file_is_refused_before_opening(tmp_path, kind):
    """--env-file naming a folder, /dev/null or a FIFO said "not found" (exit 1), and a FIFO must not be opened
    (that waits for a writer): one line saying it is not a regular file, exit 2."""
    import os

    target = {"folder": tmp_path, "device": "/dev/null", "FIFO": tmp_path / "fifo"}[kind]
    if kind == "FIFO":
        os.mkfifo(target)
    r = _cli(target, "status", STATE_DIR=str(tmp_path / "run"))  # a FIFO opened for reading would hang past timeout
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert f"configuration file {target} is not a regular file (a {kind})" in line, line


@pytest.mark.parametrize("value", ["NaN", "inf", "-5", "-1e9"])
def test_a_memory_margin_that_is_no_amount_is_one_line_naming_it(tmp_path, value):
    """MEMORY_MARGIN_GIB=NaN or inf ended start and doctor in a traceback (int() of the margin in the host memory
    check); a negative one passed ("plus -5 GiB"). Refused like the other numbers: one line, exit 2 (doctor lists it
    as its failing config check)."""
    env = tmp_path / "tpu.env"
    env.write_text(f"MODEL_NAME=org/m\nSTATE_DIR={tmp_path}/run\n")
    r = _cli(env, "status", MEMORY_MARGIN_GIB=value)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert f"MEMORY_MARGIN_GIB={float(value)}, set in the environment, must be 0 to 1024 GiB" in line, line


@pytest.mark.parametrize("value", ["x\ny", "x\ty", "../../evil", "a b"])
def test_a_served_name_from_the_file_keeps_the_rule_of_served_name(tmp_path, monkeypatch, value):
    """--served-name ../../x is refused, but SERVED_MODEL_NAME from tpu.env or the environment was launched as it
    was (a newline split status and stop's lines in two): the same rule, one line naming where it was set."""
    said = _refused_from_the_environment(tmp_path, monkeypatch, "SERVED_MODEL_NAME", value)
    assert said.startswith("SERVED_MODEL_NAME=") and "set in the environment" in said and "\n" not in said, said


@pytest.mark.parametrize("key", ["STATE_DIR", "MODEL_NAME"])
def test_a_control_character_in_a_path_setting_is_one_line_naming_it(tmp_path, monkeypatch, key):
    """STATE_DIR with a newline was taken, and status printed its path over two lines."""
    said = _refused_from_the_environment(tmp_path, monkeypatch, key, f"{tmp_path}/x\ny")
    assert said.startswith(f"{key}=") and "control character ('\\n')" in said and "\n" not in said, said


@pytest.mark.parametrize("value", ["a\nb", "", "é✓名", "a b"])
def test_a_host_that_is_no_address_is_one_line_naming_it(tmp_path, monkeypatch, value):
    """HOST with a newline split doctor's lines (and its port check named "a\\nb"); an empty one read "HOST is ,
    reachable beyond this machine". One line naming HOST, exit 2."""
    said = _refused_from_the_environment(tmp_path, monkeypatch, "HOST", value)
    assert said.startswith("HOST=") and "set in the environment" in said and "\n" not in said, said


@pytest.mark.parametrize("name,value", [("DTYPE", "flaot16"), ("CPU_DTYPE", "fp16"), ("KV_CACHE_DTYPE", "fp9"),
                                        ("SWAP_SIZE_GIB", "0"), ("SWAP_SIZE_GIB", "-4"), ("SWAP_SIZE_GIB", "100000"),
                                        ("SWAPFILE", "")])
def test_a_setting_its_use_cannot_take_is_one_line_naming_it(tmp_path, monkeypatch, name, value):
    """A --dtype or --kv-cache-dtype vLLM has no such choice for was launched and failed minutes later in vLLM's own
    words; SWAP_SIZE_GIB=0 and an empty SWAPFILE reached dd and swapon (exit 1). One line naming it, before any."""
    said = _refused_from_the_environment(tmp_path, monkeypatch, name, value)
    assert said.startswith(f"{name}={value}, set in the environment") and "\n" not in said, said


@IN_PROCESS_TORCH
def test_the_dtype_choices_are_the_installed_vllms():
    import typing

    from vllm.config.cache import CacheDType
    from vllm.config.model import ModelDType

    from tools.serving.config import DTYPES, KV_CACHE_DTYPES

    assert DTYPES == typing.get_args(ModelDType) and KV_CACHE_DTYPES == typing.get_args(CacheDType)


def _refused_from_the_environment(tmp_path, monkeypatch, name: str, value: str) -> str:
    """The one-line refusal load_config gives for `name`=`value` set in the environment (beside a valid env file)."""
    from tools.core.errors import BadInput

    env = tmp_path / "tpu.env"
    env.write_text(f"MODEL_NAME=org/m\nSTATE_DIR={tmp_path}/run\n")
    monkeypatch.setenv(name, value)
    with pytest.raises(BadInput) as exc:
        load_config(env)
    return str(exc.value)
