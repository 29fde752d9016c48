"""Named instances: several vLLM servers from one STATE_DIR, each with its own port, state file and log.

The default instance keeps STATE_DIR/vllm.json and vllm.log; instance NAME uses STATE_DIR/NAME/. Before a start
`plan` refuses what another instance already holds (its port, its CPU cores, its share of a GPU) and vLLM
parallelism the machine cannot give, and fills in the cores or GPUs this start gets.
"""

from __future__ import annotations

import fcntl
import threading
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

from tools.core.errors import BadInput, ToolFailure, op, param
from tools.gpu.vram import server_process_pids
from tools.serving.records import files, router_state, state
from tools.serving.config import INSTANCE_NAME, ServeConfig, check_instance_name
from tools.serving.records.router_state import RouterRead


class Hold:
    """STATE_DIR/.instances.lock as one thread of this process holds it, and the plans made under it. A plan stands
    only while the hold it was made under does: once released, another start may take the same cores or port."""

    def __init__(self, path: Path, fh: Any) -> None:
        self.path = path
        self._fh = fh
        self._plans: list[tuple[ServeConfig, Any, ServeConfig]] = []

    @property
    def held(self) -> bool:
        return self._fh is not None

    def plan(self, cfg: ServeConfig, hw: Any, *, router: RouterRead = "read") -> ServeConfig:
        """`plan(cfg, hw)`, made once under this hold: asked again for the same config and hardware (a switch's
        plan, then its launch), the plan already made."""
        if self._fh is None:
            raise RuntimeError(f"{self.path} is no longer held: a plan made now could be another start's")
        for asked, on, planned in self._plans:
            if on is hw and asked == cfg:
                return planned
        planned = plan(cfg, hw, router=router)
        self._plans.append((cfg, hw, planned))
        return planned

    def release(self) -> None:
        fh, self._fh = self._fh, None
        self._plans.clear()
        if fh is not None:
            fcntl.flock(fh, fcntl.LOCK_UN)
            fh.close()


_HELD = threading.local()  # path -> the Hold this thread has (a nested `locked` in the same thread joins it)


@contextmanager
def locked(cfg: ServeConfig, hold: Hold | None = None) -> Iterator[Hold]:
    """Holds STATE_DIR/.instances.lock: the checks and the launch of one start are not interleaved with another.
    `hold`: one taken before by this thread (a switch's, with B's plan made under it) handed over, used while it is
    still held and released with this block; a block inside another of this thread joins it (released by the
    outer one)."""
    root = Path(cfg.state_dir)
    path = root / ".instances.lock"
    held: dict[str, Hold] = _HELD.__dict__.setdefault("by_path", {})
    if hold is None or not hold.held or hold.path != path:
        hold = held.get(str(path))
        if hold is not None and hold.held:
            yield hold
            return
        root.mkdir(parents=True, exist_ok=True)
        fh = files.open_lock(path, "a")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX)
        except BaseException:
            fh.close()
            raise
        hold = Hold(path, fh)
    held[str(path)] = hold
    try:
        yield hold
    finally:
        hold.release()
        if held.get(str(path)) is hold:
            del held[str(path)]


def instance_configs(cfg: ServeConfig) -> list[ServeConfig]:
    """The default instance and every named one with a state file, as configs of their own (sorted by name)."""
    out = [replace(cfg, instance="")]
    root = Path(cfg.state_dir)
    if root.is_dir():
        for d in sorted(root.iterdir()):
            if d.is_dir() and INSTANCE_NAME.fullmatch(d.name) and files.present(d / "vllm.json"):
                out.append(replace(cfg, instance=d.name))
    return out


def running(cfg: ServeConfig, *, exclude: str | None = None) -> dict[str, Any]:
    """name -> ServerState of every instance whose server is alive (its group counts: a leader that died with
    its engine still on the GPU holds what it held)."""
    out: dict[str, Any] = {}
    for c in instance_configs(cfg):
        if exclude is not None and c.instance == exclude:
            continue
        try:
            st = state.load_state(c)
        except ToolFailure:
            continue
        if st is not None and (state.leader(st) is not None or state.our_group(st)):
            out[c.instance_name] = st
    return out


def resolve(cfg: ServeConfig, name: str | None) -> Any:
    """The ServerState of a running instance, or a one-line refusal naming what runs."""
    inst = check_instance_name(name)
    alive = running(cfg)
    key = replace(cfg, instance=inst).instance_name
    if key not in alive:
        names = ", ".join(alive) or "none"
        raise BadInput(f"instance {key!r} is not running (running: {names}); start it with "
                       f"{op('start', instance=inst) if inst else op('start')}",
                       {"instance": key, "running": list(alive)})
    return alive[key]


def _cores_of(st: Any, all_cores: list[int]) -> set[int]:
    if st.platform != "cpu":
        return set()
    if not st.cpu_cores:  # unbound: vLLM's automatic binding spreads over every core
        return set(all_cores)
    return {c for rank in st.cpu_cores for c in rank}


def plan(cfg: ServeConfig, hw: Any, *, router: RouterRead = "read") -> ServeConfig:
    """This start's config with its cores (CPU) or GPUs filled in; ToolFailure/BadInput when it cannot fit."""
    others = running(cfg, exclude=cfg.instance)
    for name, st in others.items():
        if st.port == cfg.port:
            raise BadInput(f"port {cfg.port} is held by instance {name!r} ({st.served_name}, pid {st.pid}); pass another "
                           f"{param('port')}", {"port": cfg.port, "instance": name})
    r = router_state.recorded(cfg) if isinstance(router, str) else router
    if r is not None and r.port == cfg.port:
        raise BadInput(f"port {cfg.port} is held by the router (pid {r.pid}); pass another {param('port')}",
                       {"port": cfg.port})
    ranks = cfg.tensor_parallel_size * cfg.data_parallel_size
    if hw.platform() == "cpu":
        return _plan_cpu(cfg, hw, others, ranks)
    return _plan_gpu(cfg, hw, others, ranks)


def _plan_cpu(cfg: ServeConfig, hw: Any, others: dict[str, Any], ranks: int) -> ServeConfig:
    if cfg.gpus is not None:
        raise BadInput(f"{param('gpus', cfg.gpus)}: no NVIDIA GPU answers NVML on this machine",
                       {"gpus": cfg.gpus})
    cores = hw.cpu_cores()
    if not others and not cfg.instance and ranks == 1 and not cfg.cpus:
        return cfg  # the default instance alone: vLLM's own binding, as before instances
    taken: dict[int, str] = {}
    for name, st in others.items():
        for c in _cores_of(st, cores):
            taken.setdefault(c, name)
    free = [c for c in cores if c not in taken]
    held = "; ".join(f"{n}: cores {sorted(c for c, o in taken.items() if o == n)}" for n in dict.fromkeys(taken.values()))
    if cfg.cpus is not None:
        want = cfg.cpus
        if want > len(free):
            raise BadInput(f"{param('cpus', want)}: only {len(free)} of {len(cores)} cores are free ({held or 'none held'}); "
                           "pass fewer or stop an instance", {"cpus": want, "free": free})
    else:
        # An even share of the machine, so a second instance still finds cores; fewer when that is all that is free.
        want = min(max(ranks, len(cores) // 2), len(free))
    if want == 0:
        raise ToolFailure(f"no free CPU core for another instance: all {len(cores)} are bound ({held}); stop an "
                          "instance first (each instance gets cores of its own)", {"cores": cores, "held": held})
    if want < ranks:
        raise BadInput(f"TENSOR_PARALLEL_SIZE x DATA_PARALLEL_SIZE = {ranks} vLLM ranks need a core each, only "
                       f"{want} free here ({held or 'none held'})", {"ranks": ranks, "free": free})
    mine = free[:want]
    per = want // ranks
    return replace(cfg, cpu_cores=[mine[i * per:(i + 1) * per] for i in range(ranks)])


def _plan_gpu(cfg: ServeConfig, hw: Any, others: dict[str, Any], ranks: int) -> ServeConfig:
    count = hw.gpu_count()
    gpus = cfg.gpus
    if gpus is not None:
        bad = [g for g in gpus if g < 0 or g >= count]
        if bad or len(set(gpus)) != len(gpus):
            raise BadInput(f"{param('gpus', gpus)}: this machine has GPUs 0..{count - 1} (each once)",
                           {"gpus": gpus, "gpu_count": count})
    visible = len(gpus) if gpus is not None else count
    if ranks > visible:
        raise BadInput(f"TENSOR_PARALLEL_SIZE={cfg.tensor_parallel_size} x DATA_PARALLEL_SIZE="
                       f"{cfg.data_parallel_size} needs {ranks} GPUs, {visible} visible"
                       + (f" ({param('gpus', gpus)})" if gpus is not None else "")
                       + f"; lower them in tpu.env or give more {param('gpus')}",
                       {"ranks": ranks, "visible": visible})
    # vLLM's --gpu-memory-utilization is each instance's share of a card's total: shares on one card add up.
    def claims_on(g: int) -> dict[str, float]:
        return {n: (st.gpu_memory_utilization or 0.9) for n, st in others.items() if st.platform == "cuda" and g in
                (st.gpus if st.gpus is not None else range(st.tensor_parallel_size * st.data_parallel_size))}

    # Without --gpus: the least claimed GPUs (one instance per GPU on a multi-T4 VM), lowest index first.
    by_room = sorted(range(count), key=lambda g: sum(claims_on(g).values()))
    used = gpus if gpus is not None else sorted(by_room[:ranks])
    for g in used:
        claims = claims_on(g)
        total = sum(claims.values())
        if claims and total + cfg.gpu_memory_utilization > 1.0 + 1e-9:
            room = max(0.0, 1.0 - total)
            listed = ", ".join(f"{n} {u:g}" for n, u in claims.items())
            at = param("gpu_memory_utilization", cfg.gpu_memory_utilization)
            raise ToolFailure(f"GPU {g} has no room for another instance at {at}: {listed} already claim "
                              f"{total:g} of it; pass at most {room:.2f} (or another {param('gpus')})",
                              {"gpu": g, "claims": claims, "room": room})
    return replace(cfg, gpus=used if (gpus is not None or others) else None)


def process_owners(cfg: ServeConfig) -> dict[int, str]:
    """pid -> instance name for every process of every running instance (GPU processes are marked with it)."""
    owners: dict[int, str] = {}
    for name, st in running(cfg).items():
        for pid in server_process_pids(st.pid) | {st.pid}:
            owners.setdefault(pid, name)
    return owners


__all__ = ["Hold", "instance_configs", "locked", "plan", "process_owners", "resolve", "running"]
