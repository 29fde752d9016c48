"""A start's progress as phases read from the engine log: launch, load weights, profile/KV cache,
compile/warm-up, ready, each with a fraction that only rises. A report goes out when the phase changes, and
every HEARTBEAT_S otherwise (the caller's cancellation point: a cancelled job stops at its next report), with
the log's newest line when it was not reported before, else the phase and the seconds since the launch. Never
the same line twice."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from tools.core.progress import Progress
from tools.serving.server import engine_log

# (phase, fraction where it begins, what in a log line says it has begun). vLLM's order differs by platform
# (the CPU build warms up before it sizes the KV cache, CUDA profiles first): the fraction stays monotone.
PHASES: list[tuple[str, float, re.Pattern | None]] = [
    ("launch", 0.0, None),
    ("load weights", 0.10, re.compile(r"Starting to load model|Loading safetensors|Loading weights")),
    ("profile/KV cache", 0.40, re.compile(r"KV cache size|profil|Memory profiling|available KV cache memory",
                                          re.IGNORECASE)),
    ("compile/warm-up", 0.60, re.compile(r"Warming up|torch\.compile|Compiling a graph|Capturing CUDA graph|"
                                         r"compile range|init engine")),
    ("ready", 0.90, None),  # /health answers; the first completion remains
]
HEARTBEAT_S = 5.0


@dataclass
class StartProgress:
    """Feed it the log (and whether /health answers) once a poll; it calls `report` only with news."""

    report: Progress | None  # (share of the start done, 1.0, the phase)
    phase: int = 0
    fraction: float = 0.0
    phase_since: float = field(default_factory=time.monotonic)
    last_sent: float = 0.0
    sent_lines: set[str] = field(default_factory=set)
    seen: int = 0          # log lines already scanned
    t0: float = field(default_factory=time.monotonic)

    current: int = 0       # the phase the log says now (the fraction follows the furthest one reached)

    def _enter(self, index: int) -> bool:
        if index == self.current:
            return False
        self.current = index
        if index > self.phase:
            self.phase = index
            self.phase_since = time.monotonic()
            self.fraction = max(self.fraction, PHASES[index][1])
        return True

    def poll(self, log_text: str, healthy: bool) -> None:
        lines = [engine_log.strip_prefix(ln)[:200] for ln in log_text.splitlines() if ln.strip()]
        changed = self.last_sent == 0.0  # the first poll reports the launch
        for line in lines[self.seen:]:
            for i, (_, _, pattern) in enumerate(PHASES):
                if pattern is not None and pattern.search(line):
                    changed |= self._enter(i)
        self.seen = len(lines)
        if healthy and self.current != len(PHASES) - 1:
            changed |= self._enter(len(PHASES) - 1)
        # Within a phase the fraction creeps towards the next phase's start, never reaching it.
        nxt = PHASES[self.phase + 1][1] if self.phase + 1 < len(PHASES) else 0.99
        base = PHASES[self.phase][1]
        creep = base + (nxt - base) * 0.9 * (1 - 1 / (1 + (time.monotonic() - self.phase_since) / 60))
        self.fraction = max(self.fraction, min(creep, nxt))
        latest = lines[-1] if lines else ""
        now = time.monotonic()
        fresh = bool(latest) and latest not in self.sent_lines
        if self.report is None or not (changed or now - self.last_sent >= HEARTBEAT_S):
            return
        name = PHASES[self.current][0]
        text = f"{name}: {latest}" if fresh else f"{name} ({now - self.t0:.0f} s)"
        if fresh:
            self.sent_lines.add(latest)
        self.last_sent = now
        self.report(round(self.fraction, 3), 1.0, text)

    def done(self, message: str) -> None:
        if self.report is not None:
            self.report(1.0, 1.0, message)


__all__ = ["HEARTBEAT_S", "PHASES", "StartProgress"]
