"""The ``shared_prefix`` workload: many groups of requests that share a long system
prompt, each a short fresh question and a long answer, at a rate that ramps.

What a capacity planner tries a fleet with (issue 41): the groups' prompts together
fill about three quarters of 8 replicas' KV cache of 4,096 blocks (96 prompts of 4,096
tokens: six times what one replica holds), so where each group goes decides the
fleet's hits, and past the fleet's capacity every prefix computed twice is throughput
lost. It is the chat workload with other defaults (single-turn sessions, many apps,
mildly skewed): every ``--chat-*`` flag still applies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from loadtest.workloads.base import Workload, WorkloadOptions, configured
from loadtest.workloads.chat import Chat, ChatConfig, chat_workload

#: The workload's defaults, beside ChatConfig's own.
SHARED_PREFIX = {
    "num_apps": 96,
    "app_skew": 0.6,
    "system_prompt_tokens": 4096,
    "mean_turns": 1.0,
    "max_turns": 1,
    "user_tokens": 32,
    "reply_tokens": 400,
    "num_sessions": 3000,
    "session_rate": 8.0,
    "rate_shape": "ramp",
}


class SharedPrefix(Chat):
    """``shared_prefix``: the chat service's parameters, with :data:`SHARED_PREFIX`'s
    defaults (its load is the fleet's, whatever its size: it does not grow with it)."""

    name = "shared_prefix"
    usage = "shared_prefix"
    defaults = SHARED_PREFIX

    def build(self, argument: str, overrides: Mapping[str, Any]) -> Workload:
        config = configured(ChatConfig, {**SHARED_PREFIX, **overrides}, self.name)
        return replace(chat_workload(config), name=self.name)

    def overrides(self, options: WorkloadOptions) -> dict[str, Any]:
        return {**options.chat, "seed": options.seed}

    def scales_with_fleet(self, options: WorkloadOptions) -> bool:
        return False
