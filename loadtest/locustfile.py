"""Locust users that play the replayer's sessions against an OpenAI-compatible gateway.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000            # web UI
    locust -f loadtest/locustfile.py --host URL --headless -u 16 -r 4 -t 2m

Each user takes the next session of the seeded workload (``--workload chat`` or
``trace:PATH``, the same generators as ``prefix-router replay``) and plays its turns
in order, streaming every request. Besides each request's total time, Locust shows
``TTFT`` (time to the first token) and ``ITL`` (mean time between tokens) as their
own entries. The usage block's prompt and cached tokens are summed, so a client-side
hit rate can be compared with the replicas' own (``--results-file``), and that hit rate
is in Locust's own figures as the run goes (``HIT%`` entries, a "Cache hits" tab: see
``loadtest/locust_hits.py``), so in its ``--csv`` files and ``--html`` report. The chat
workload takes ``prefix-router replay``'s ``--chat-*`` flags (or ``PR_CHAT_*``
variables). Once every session has been played, the test ends.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import gevent
import numpy as np
from locust import HttpUser, constant, events, task
from locust.env import Environment

from deploy.flags import add_config_flags, config_overrides
from loadtest.locust_hits import CacheHits, install_web_ui
from loadtest.workloads import (
    ChatConfig,
    Session,
    Turn,
    Workload,
    WorkloadOptions,
    workload_for,
    workload_usage,
)
from replica.api.identity import DEFAULT_MODEL

#: The header that carries a session's key (the gateway reads it by default).
SESSION_HEADER = "x-session-id"


@events.init_command_line_parser.add_listener
def add_options(parser: Any) -> None:
    group = parser.add_argument_group("prefix-router workload")
    group.add_argument("--workload", default="chat", env_var="PR_WORKLOAD", help=workload_usage())
    group.add_argument("--workload-seed", type=int, default=0, env_var="PR_WORKLOAD_SEED")
    group.add_argument(
        "--trace-limit", type=int, default=0, env_var="PR_TRACE_LIMIT", help="0: all"
    )
    group.add_argument(
        "--think-time-scale",
        type=float,
        default=1.0,
        env_var="PR_THINK_TIME_SCALE",
        help="multiply the sessions' think times (0: no pauses)",
    )
    group.add_argument(
        "--arrival-rate",
        type=float,
        default=0.0,
        env_var="PR_ARRIVAL_RATE",
        help="open loop: new sessions per second, whatever the answers' pace (0: closed loop; "
        "traces keep their timestamps); run enough users to cover the concurrency",
    )
    group.add_argument(
        "--gateways",
        default="",
        env_var="PR_GATEWAYS",
        help="comma-separated base URLs: each request goes to one at random (default: --host)",
    )
    group.add_argument("--model", default=DEFAULT_MODEL, env_var="PR_MODEL")
    group.add_argument(
        "--session-keys",
        action="store_true",
        env_var="PR_SESSION_KEYS",
        help=f"send each session's id as {SESSION_HEADER} (the gateway's default session key)",
    )
    group.add_argument(
        "--results-file", default="", env_var="PR_RESULTS_FILE", help="client figures as JSON"
    )
    group.add_argument(
        "--api-key",
        default="",
        env_var="PR_API_KEY",
        help="sent as a bearer token with every request (a gateway's API key; a router "
        "that asks its clients for the fleet's token)",
    )
    # The chat workload's parameters, as ``prefix-router replay`` takes them.
    add_config_flags(parser, ChatConfig, prefix="chat-", skip=("seed",), env_prefix="PR_CHAT_")


class Sessions:
    """The workload's sessions, handed out in order to whichever user asks next."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self._next = 0
        self._finished = 0
        self._lock = threading.Lock()

    def finish(self) -> bool:
        """Count one session played; True once every session has been."""
        with self._lock:
            self._finished += 1
            return self._finished == len(self.workload.sessions)

    def take(self) -> Session | None:
        with self._lock:
            if self._next >= len(self.workload.sessions):
                return None
            self._next += 1
            return self.workload.sessions[self._next - 1]


class Tally:
    """Client-side figures: every answer's usage block and latency, and in open loop
    when each session started against when it was due."""

    def __init__(self) -> None:
        self.session_starts: list[tuple[float, float]] = []  # (due, started), seconds
        self.ttft_s: list[float] = []
        self.e2e_s: list[float] = []
        #: Each streamed request's inter-token latencies, beside its TTFT.
        self.token_gaps: list[list[float]] = []
        #: (wall time sent, TTFT, prompt tokens, cached tokens) per answer with usage:
        #: the bench's charts over time.
        self.answers: list[tuple[float, float, int, int]] = []
        self._lock = threading.Lock()

    def add_latency(self, ttft_s: float, e2e_s: float, gaps: list[float]) -> None:
        with self._lock:
            self.ttft_s.append(ttft_s)
            self.e2e_s.append(e2e_s)
            self.token_gaps.append(gaps)

    def add_answer(
        self, sent: float, ttft_s: float, prompt_tokens: int, cached_tokens: int
    ) -> None:
        with self._lock:
            self.answers.append((sent, ttft_s, prompt_tokens, cached_tokens))

    def as_dict(self) -> dict[str, Any]:
        prompt_tokens = sum(prompt for *_, prompt, _ in self.answers)
        cached_tokens = sum(cached for *_, cached in self.answers)
        rate = cached_tokens / prompt_tokens if prompt_tokens else None
        late = sum(started - due > 0.1 for due, started in self.session_starts)
        return {
            "requests": len(self.answers),  # those whose usage came back
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "client_token_hit_rate": rate,
            "session_starts": self.session_starts,
            "late_session_starts": late,  # open loop with too few users to keep pace
            "ttft_s": self.ttft_s,  # per streamed request, exact (Locust's are bucketed)
            "e2e_s": self.e2e_s,
            "token_gaps": [[round(gap, 6) for gap in gaps] for gaps in self.token_gaps],
            "answers": self.answers,
        }


SESSIONS: Sessions | None = None
TALLY = Tally()
HITS = CacheHits()  # the same usage blocks, in Locust's statistics and web UI
TEST_START = [0.0]  # monotonic time the test started (open loop schedules from it)
FRONTS: list[list[str]] = [[]]  # the gateways requests are spread over (--gateways)
RNG = np.random.default_rng(0)  # which gateway: seeded, so runs repeat


@events.test_start.add_listener
def mark_start(**_: Any) -> None:
    TEST_START[0] = time.monotonic()


@events.init.add_listener
def show_hits(environment: Environment, **_: Any) -> None:
    install_web_ui(environment, HITS)


@events.reset_stats.add_listener
def reset_hits(**_: Any) -> None:
    HITS.reset()  # the web UI's "Reset stats" button


@events.init.add_listener
def load_sessions(environment: Environment, **_: Any) -> None:
    global SESSIONS
    options = environment.parsed_options
    if options is None:
        return
    chat = config_overrides(options, ChatConfig, prefix="chat_")
    if options.arrival_rate > 0:  # open loop: sessions start at this rate
        chat["session_rate"] = options.arrival_rate
    limit = options.trace_limit or None
    asked = WorkloadOptions(seed=options.workload_seed, chat=chat, limit=limit)
    SESSIONS = Sessions(workload_for(options.workload, asked))
    FRONTS[0] = [url.rstrip("/") for url in options.gateways.split(",") if url]


@events.quitting.add_listener
def write_results(environment: Environment, **_: Any) -> None:
    options = environment.parsed_options
    if options is not None and options.results_file:
        with open(options.results_file, "w", encoding="utf-8") as out:
            json.dump(TALLY.as_dict(), out, indent=2)


class ChatSessionUser(HttpUser):
    """A closed-loop user: one session after another, each turn after its think time."""

    wait_time = constant(0)

    @task
    def play_session(self) -> None:
        assert SESSIONS is not None, "the workload is loaded at Locust's init event"
        session = SESSIONS.take()
        if session is None:
            self.stop()  # every session has been played
            return
        options = self.environment.parsed_options
        if options.arrival_rate > 0 or SESSIONS.workload.arrival == "trace":
            self.wait_until_due(session)
        scale = options.think_time_scale
        for turn in session.turns:
            if turn.think_time_s and scale:
                time.sleep(turn.think_time_s * scale)  # gevent-patched: yields to other users
            self.send(turn, session)
        if SESSIONS.finish() and self.environment.runner is not None:
            # The whole workload is played: end the test now rather than at --run-time.
            # (a moment later, so the last request's figures reach Locust's statistics)
            gevent.spawn_later(1.0, self.environment.runner.quit)

    def wait_until_due(self, session: Session) -> None:
        """Open loop: a session starts at its scheduled time, not when a user is free."""
        due = session.start_time_s
        delay = TEST_START[0] + due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        TALLY.session_starts.append((due, time.monotonic() - TEST_START[0]))

    def send(self, turn: Turn, session: Session) -> None:
        """One turn, naming the session's model or adapter (else ``--model``)."""
        options = self.environment.parsed_options
        path, name, body = _request(turn, session.served_name or options.model)
        headers = {SESSION_HEADER: session.session_id} if options.session_keys else {}
        if options.api_key:
            headers["authorization"] = f"Bearer {options.api_key}"
        sent = time.time()  # wall clock: the bench's samples of the fleet use it too
        start = time.perf_counter()
        with self.client.post(
            self.front() + path,
            json=body,
            headers=headers,
            stream=True,
            catch_response=True,
            name=name,
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            stream = _Stream()
            for line in response.iter_lines():
                stream.read(line)
            end = time.perf_counter()
            # Locust timed the headers only (stream=True): report the whole answer.
            response.request_meta["response_time"] = (end - start) * 1000
            if stream.first is None:
                response.failure("the stream ended without a token")
                return
        first = stream.first - start
        TALLY.add_latency(first, end - start, stream.gaps)
        if stream.usage is not None:
            HITS.add(self.environment, name, *stream.usage)
            TALLY.add_answer(sent, first, *stream.usage)
        self._report("TTFT", name, first * 1000)
        if stream.tokens > 1:
            self._report("ITL", name, (stream.last - stream.first) * 1000 / (stream.tokens - 1))

    def front(self) -> str:
        """The gateway for the next request: one of ``--gateways`` at random, else the
        host's (an empty prefix)."""
        fronts = FRONTS[0]
        return fronts[int(RNG.integers(len(fronts)))] if fronts else ""

    def _report(self, kind: str, name: str, milliseconds: float) -> None:
        self.environment.events.request.fire(
            request_type=kind,
            name=name,
            response_time=milliseconds,
            response_length=0,
            exception=None,
            context={},
        )


def _usage(usage: dict[str, Any]) -> tuple[int, int]:
    """Prompt and cached tokens of a usage block (``cached_tokens`` may be absent)."""
    details = usage.get("prompt_tokens_details") or {}
    return int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0)


def _request(turn: Turn, model: str) -> tuple[str, str, dict[str, Any]]:
    """A turn as a streamed OpenAI request: its path, Locust's name for it, its body."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": turn.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if turn.messages is not None:
        body["messages"] = list(turn.messages)
        return "/v1/chat/completions", "chat", body
    body["prompt"] = turn.prompt_token_ids.tolist()
    turn.forget_prompt()
    return "/v1/completions", "completion", body


class _Stream:
    """What one SSE answer showed: when its tokens came, and its usage block."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last = 0.0
        self.tokens = 0
        self.gaps: list[float] = []
        self.usage: tuple[int, int] | None = None

    def read(self, line: bytes) -> None:
        if not line.startswith(b"data: {"):
            return
        chunk = json.loads(line[6:])
        if chunk.get("usage") and not chunk.get("choices"):
            self.usage = _usage(chunk["usage"])
            return
        choice = chunk["choices"][0] if chunk.get("choices") else {}
        if not (choice.get("text") or (choice.get("delta") or {}).get("content")):
            return  # a role announcement, not a token
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now
        self.tokens += 1
