"""Where a gateway's CPU goes, by stage of the request path: py-spy's samples of a
running gateway, each given to the stage of its innermost frame that names one.

    python -m benchmarks.bench_gateway --profile   (profiles one throughput round)

py-spy (PyPI ``py-spy``) samples every thread of the process from outside, with their
native frames (``--native``): a sample in C code (a socket write, the event loop's
poll) is given to the innermost Python frame that names a stage, so a write to the
replica is the upstream call's and the answer's write is the relay's. A sample that
waits (in ``poll``, or for the GIL) is left out: the shares are of the gateway's CPU.
(Without ``--native`` py-spy cannot tell a thread waiting in C from one working there,
and gave the upstream write a fifth of every sample.)
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: The request path's stages (router/gateway.py), and what around them costs: each a
#: pattern on py-spy's frames, "function (file:line)". The first stage whose pattern
#: matches a sample's innermost frame that any matches is the sample's.
STAGES: tuple[tuple[str, str], ...] = (
    ("tokenizing", r"replica/api/(tokenizer|model_tokenizer|token_cache|chat_)|request_prompts"),
    ("reading and parsing the body", r"router/path/envelope\.py|starlette/requests\.py|\.receive "),
    ("keys", r"router/path/resolve\.py|router/index/key_cache\.py|prefix_keys"),
    ("admission", r"router/path/admit\.py|router/fair/"),
    ("the decision", r"router/path/place\.py|router/policies/|router/index/|load_order"),
    (
        "accounting and metrics",
        r"router/path/(accounting|settle|latency)\.py|router/fleet/load\.py|metrics|prometheus",
    ),
    (
        "relaying the answer",
        r"(_whole|_relay|_lines|_first_line) \(router/path/dispatch|starlette/responses\.py"
        r"|RequestResponseCycle\.send ",
    ),
    ("the upstream call", r"router/fleet/http_client\.py|router/path/dispatch\.py"),
    ("the gateway's glue", r"router/gateway\.py|router/http/app\.py|router/fleet/"),
    ("HTTP server (uvicorn's parser, the hot path)", r"uvicorn/protocols|router/http/hot_path"),
)
#: Work that is not a request's: following the replicas' KV events and load reports.
BACKGROUND = (
    "background (KV events, load reports, health)",
    r"kv_subscriber|KVStreams|zmq|backend_check|aiohttp|Thread\.run",
)
#: What is left: the event loop itself (epoll, socket reads, scheduling callbacks).
EVENT_LOOP = "event loop (poll, socket reads, callbacks)"
#: A sample whose innermost native frames wait, for a socket or for the GIL: no CPU.
WAITING_RE = re.compile(r"^(e?poll|epoll_pwait|select|pthread_cond_(timed)?wait|sem_wait|futex)\b")
COMPILED = [(name, re.compile(pattern)) for name, pattern in STAGES]
BACKGROUND_RE = re.compile(BACKGROUND[1])


@dataclass(frozen=True)
class StageProfile:
    """Samples per stage, and their total."""

    samples: dict[str, int]
    total: int

    def share(self, stage: str) -> float:
        return self.samples.get(stage, 0) / self.total if self.total else 0.0

    def table(self, cpu_per_request_us: float | None = None) -> str:
        """One line per stage: its share and, given the CPU per request, its microseconds."""
        lines = []
        for stage in ordered_stages():
            share = self.share(stage)
            us = f"  {share * cpu_per_request_us:6.1f} us" if cpu_per_request_us else ""
            lines.append(f"  {stage:<52} {share:6.1%}{us}")
        lines.append(f"  {'(samples)':<52} {self.total:6d}")
        return "\n".join(lines)


def ordered_stages() -> list[str]:
    return [name for name, _ in STAGES] + [BACKGROUND[0], EVENT_LOOP]


def stage_of(frames: Sequence[str]) -> str:
    """The stage of one sample, its frames from the outermost to the innermost."""
    if any(BACKGROUND_RE.search(frame) for frame in frames):
        return BACKGROUND[0]
    for frame in reversed(frames):
        for name, pattern in COMPILED:
            if pattern.search(frame):
                return name
    return EVENT_LOOP


def by_stage(raw: Iterable[str]) -> StageProfile:
    """Count py-spy's raw (collapsed) output, one "frame;frame;... count" a line, by stage."""
    samples: collections.Counter[str] = collections.Counter()
    for line in raw:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if stack and count.isdigit():
            frames = stack.split(";")
            if not waiting(frames):
                samples[stage_of(frames)] += int(count)
    return StageProfile(dict(samples), sum(samples.values()))


def waiting(frames: Sequence[str]) -> bool:
    """Whether a sample waits (its two innermost native frames: an address within one)."""
    return any(WAITING_RE.match(frame) for frame in frames[-2:])


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(__file__).parents[1] / ".venv/bin/py-spy")
    if not Path(found).exists():
        raise RuntimeError("py-spy is not installed: pip install py-spy (make install does)")
    return found


def record(
    pids: Sequence[int], seconds: float, out: Path, rate: int = 250
) -> list[subprocess.Popen]:
    """Start py-spy on each of ``pids`` for ``seconds``; each writes ``out``-PID.txt."""
    return [
        subprocess.Popen(
            [
                py_spy(),
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(max(1, round(seconds))),
                "--rate",
                str(rate),
                "--native",
                "--format",
                "raw",
                "--output",
                f"{out}-{pid}.txt",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid in pids
    ]


def collected(spies: Sequence[subprocess.Popen], out: Path, pids: Sequence[int]) -> StageProfile:
    """Wait for the recordings and count them together."""
    for spy in spies:
        spy.wait(timeout=120)
    lines: list[str] = []
    for pid in pids:
        path = Path(f"{out}-{pid}.txt")
        if path.exists():
            lines += path.read_text().splitlines()
    return by_stage(lines)
