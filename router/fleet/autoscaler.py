"""How many replicas the fleet should run, and which one to stop first.

The decision is Ray Serve's (``target_ongoing_requests``, ``upscale_delay_s``,
``downscale_delay_s``), on the signals a prefix-cached fleet queues up: the requests
in flight or waiting (in the engines and in the gateway's queue), and the prompt
tokens waiting to be prefilled. The fleet wants as many replicas as either signal
needs at its target per replica, within ``[min_replicas, max_replicas]``; a wish to
grow is acted on once it has held for ``upscale_delay_s``, in one go, as Ray Serve's
does; one to shrink once it has held for ``downscale_delay_s`` (a burst's trough does
not tear the fleet down), one replica at a time: each stop moves the conversations the
replica held, and several at once would move them all at once.

A disaggregated fleet scales each pool apart, on the pool's own load and its own signal
(an :class:`Autoscaler` per role, each within the bounds): prefill replicas on the
prompt tokens waiting for them (their requests last one token: their count says little
of their work), decode replicas on their requests (each holds a sequence's KV and a slot
in every step) and on the prompt tokens they prefill in place (conditional P/D
prefills there; on a replayed day of 400 document sessions, a decode pool counting its
requests alone grew to 4 and stalled its streams to an ITL p99 of 1.8 s, 112 ms counting
both; on shorter days of the same workload the two signals gave the same peaks, and
goodput within 1 to 10% either way), replicas that do both on either, as above.
NVIDIA Dynamo's planner splits the same way (prefill on its queue and TTFT, decode on
its KV load and ITL).

Which replica goes is where a cache-aware fleet differs from a load-only one: the
replica whose loss costs the caches least (``cache``: ``Policy.cache_value``, the recent
requests through the prefixes it alone holds, from the router's index). ``load`` stops
the least loaded (what a scaler that knows only load does), ``random`` any. A stopped
replica first leaves routing, finishes what it holds, and only then stops: no request
fails (the shells do that: loadtest/replay/, deploy/).

Pure: the clock and the random generator are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: How the replica to stop is chosen (see the module's doc).
SCALE_IN = ("cache", "load", "random")

#: What each role's pool is sized by (see the module's doc).
SIGNALS = {
    "both": ("ongoing_requests", "queued_prefill_tokens"),
    "prefill": ("queued_prefill_tokens",),
    "decode": ("ongoing_requests", "queued_prefill_tokens"),
}


@dataclass(frozen=True)
class AutoscaleConfig:
    """Bounds and targets; ``min_replicas == max_replicas`` is a fixed fleet."""

    min_replicas: int = 1
    max_replicas: int = 1
    #: Requests in flight or waiting per replica the fleet aims at.
    target_ongoing_requests: float = 16.0
    #: Prompt tokens waiting for prefill per replica the fleet aims at (0: not a signal).
    target_queued_prefill_tokens: float = 16_384.0
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    #: How often the fleet is looked at.
    interval_s: float = 1.0
    scale_in: str = "cache"

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas} and "
                f"{self.max_replicas}"
            )
        if self.target_ongoing_requests <= 0 or self.target_queued_prefill_tokens < 0:
            raise ValueError(
                "target_ongoing_requests must be positive and target_queued_prefill_tokens "
                "not negative"
            )
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0 or self.interval_s <= 0:
            raise ValueError(
                "upscale_delay_s and downscale_delay_s must not be negative, interval_s positive"
            )
        if self.scale_in not in SCALE_IN:
            raise ValueError(f"unknown scale_in {self.scale_in!r}; known: {', '.join(SCALE_IN)}")

    @property
    def fixed(self) -> bool:
        return self.min_replicas == self.max_replicas


@dataclass(frozen=True)
class FleetLoad:
    """What the fleet holds now: requests in flight or waiting (engines and gateway
    queue together), and prompt tokens waiting for prefill."""

    ongoing_requests: int
    queued_prefill_tokens: int


class Autoscaler:
    """The size over time of a fleet, or of one role's pool of it (``role``: a key of
    :data:`SIGNALS`): :meth:`decide` once per ``interval_s``."""

    def __init__(
        self, config: AutoscaleConfig, clock: Callable[[], float], role: str = "both"
    ) -> None:
        if role not in SIGNALS:
            raise ValueError(f"unknown role {role!r}; known: {', '.join(SIGNALS)}")
        self.config = config
        self.clock = clock
        self.role = role
        #: Since when the wish has pointed up (or down) without a break.
        self._up_since: float | None = None
        self._down_since: float | None = None

    def wanted(self, load: FleetLoad) -> int:
        """The replicas that would hold ``load`` at the targets of the role's signals,
        within the bounds (a prefill pool whose token target is 0: on its requests)."""
        config = self.config
        targets = {
            "ongoing_requests": config.target_ongoing_requests,
            "queued_prefill_tokens": config.target_queued_prefill_tokens,
        }
        signals = [s for s in SIGNALS[self.role] if targets[s]] or ["ongoing_requests"]
        need = max(getattr(load, signal) / targets[signal] for signal in signals)
        return min(config.max_replicas, max(config.min_replicas, math.ceil(need)))

    def decide(self, current: int, load: FleetLoad) -> int:
        """The size the fleet should have now: ``current`` until a wish to differ has
        held for its delay."""
        wanted, now = self.wanted(load), self.clock()
        if wanted > current:
            self._down_since = None
            self._up_since = now if self._up_since is None else self._up_since
            if now - self._up_since >= self.config.upscale_delay_s:
                self._up_since = None
                return wanted
        elif wanted < current:
            self._up_since = None
            self._down_since = now if self._down_since is None else self._down_since
            if now - self._down_since >= self.config.downscale_delay_s:
                self._down_since = None
                return max(wanted, current - 1)
        else:
            self._up_since = self._down_since = None
        return current


def to_stop(
    scale_in: str,
    replicas: Sequence[str],
    load: Mapping[str, int],
    cache_value: Callable[[str], float],
    rng: np.random.Generator,
) -> str:
    """The replica to stop first: ``cache``, the one whose loss costs the fleet's
    caches least (``cache_value``: the policy's, ``Policy.cache_value``), ties to the
    less loaded; ``load``, the least loaded (``load``: its requests); ``random``, any."""
    if scale_in == "random":
        return replicas[int(rng.integers(len(replicas)))]
    if scale_in == "load":
        return min(replicas, key=lambda r: load.get(r, 0))
    return min(replicas, key=lambda r: (cache_value(r), load.get(r, 0)))
