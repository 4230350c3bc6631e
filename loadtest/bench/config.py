"""The bench's configuration and its default load."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loadtest.replay import ReplayConfig
from loadtest.workloads import Workload, WorkloadOptions, workload_for, workload_kind
from replica.api.identity import DEFAULT_MODEL

#: The default load: a chat service a 2-core machine can drive without becoming the
#: bottleneck (Locust, gateway and four replicas together stay near half the CPU), in
#: about two minutes per policy. 180 sessions start at 3 per second; users think 3 s
#: between turns and get 120-token replies (shorter than ChatConfig's 8 s and 250, so
#: sessions finish within the run and the token stream stays light); at most 8 turns.
BENCH_CHAT: dict[str, Any] = {
    "num_sessions": 180,
    "session_rate": 3.0,
    "think_time_s": 3.0,
    "reply_tokens": 120,
    "max_turns": 8,
}


#: Blocks per replica in the embedded deployment: 16k tokens, room for the four
#: system prompts and a few dozen live sessions, not for every session everywhere.
BENCH_REPLICA_BLOCKS = 1024


#: The host tier under each: none by default, so the demo measures routing alone
#: (``--replica-host-blocks N`` adds one).
BENCH_HOST_BLOCKS = 0


@dataclass(frozen=True)
class BenchConfig:
    #: The baseline, then ours with an index learned from its own decisions only (as
    #: SGLang's router learns), then ours fed by the replicas' KV events: what routing
    #: alone buys, and what the events add.
    policies: tuple[str, ...] = ("round_robin", "cache_aware_approx", "cache_aware")
    workload: str = "chat"
    #: Overrides of the chat workload's parameters (on top of :data:`BENCH_CHAT`).
    chat: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    model: str = DEFAULT_MODEL
    #: Traces: play only the first ``trace_limit`` requests (0: all).
    trace_limit: int = 0
    #: Locust users: enough that every session starts on time (open loop).
    users: int = 64
    #: Upper bound per policy; a run ends as soon as every session has been played.
    run_time_s: float = 240.0
    predict: bool = True
    #: The cost profile of engines that are not ours (``prefix-router calibrate``), for
    #: the replay beside each live row; without it their fleet is not predicted.
    replay_profile: str = ""
    #: Whether clients send each session's id as its key (``x-session-id``).
    session_keys: bool = False
    progress: bool = True
    #: The objectives of goodput, live and in the replay beside it (ReplayConfig's).
    slo_ttft_s: float = ReplayConfig.slo_ttft_s
    slo_itl_s: float = ReplayConfig.slo_itl_s

    def chat_config(self) -> dict[str, Any]:
        return {**self._chat(), "seed": self.seed}

    def load(self) -> Workload:
        options = WorkloadOptions(seed=self.seed, chat=self._chat(), limit=self.trace_limit or None)
        return workload_for(self.workload, options)

    def _chat(self) -> dict[str, Any]:
        """:data:`BENCH_CHAT`'s lighter load under the user's overrides, but where the
        workload's kind sets its own defaults (``shared_prefix``'s long answers)."""
        own = workload_kind(self.workload).defaults
        return {**{k: v for k, v in BENCH_CHAT.items() if k not in own}, **self.chat}
