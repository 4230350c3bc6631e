"""``bench --size-load``: the load sized to the engines the bench runs on.

Real engines on a shared machine (vLLM's CPU build beside Locust and the gateway)
saturate at a rate no default can know: a load that leaves one machine's engines half
idle starves another's cores, and then every router's latencies measure the starved
CPU, not the routing. So the bench first times one of its engines (``prefix-router
calibrate``'s sweep, about 20 s; our simulated replicas need none, their twin is exact,
nor engines given a ``--replay-profile``), then replays the workload on the fleet's twin
timed by that profile, and picks the session rate at which the work of the twin's
engines, routed round robin (the policy with the fewest hits: the most work), takes the
asked share of their time while sessions arrive. Sessions arrive for as long as they
would have at the given rate: their number scales with it. The profile then stands
beside each live row (``--replay-profile``).
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench.config import BenchConfig
from loadtest.bench.targets import Fleet, discover
from loadtest.calibrate import CalibrateConfig, calibrate, report, write_calibration
from loadtest.replay import ReplayConfig, replay
from loadtest.workloads import Workload, retokenized, workload_kind
from replica.api.cost_model import get_profile
from replica.api.fleet_token import bearer
from replica.api.model_tokenizer import load_tokenizer
from replica.api.tokenizer import DEFAULT_TOKENIZER

#: The twin's policy for sizing: round robin finds the fewest hits, so its engines work most.
SIZING_POLICY = "round_robin"
#: Rates tried at most, and how close to the asked share the busy share must come.
MAX_TRIES = 12
CLOSE_ENOUGH = 0.05


@dataclass(frozen=True)
class Sizing:
    """What the sizing found: the rate and sessions chosen, the twin's busy share there,
    and the profile that timed the twin ("": our replicas' own)."""

    session_rate: float
    num_sessions: int
    busy_share: float
    profile: str

    def summary(self) -> str:
        policy = SIZING_POLICY.replace("_", " ")
        return (
            f"{self.num_sessions} sessions at {self.session_rate:.2f} per second, the twin's "
            f"engines busy {self.busy_share:.0%} of the time routed {policy}"
        )


def sized(
    config: BenchConfig, gateways: list[str], fleet_token: str, target_share: float, out: Path
) -> tuple[BenchConfig, Sizing]:
    """The bench's target found (as :func:`compare` finds it), then its load sized."""
    with httpx.Client(timeout=30.0, headers=bearer(fleet_token)) as client:
        fleet = discover(client, gateways, fleet_token)
    return size_load(config, fleet, target_share, out)


def size_load(
    config: BenchConfig, fleet: Fleet, target_share: float, out: Path
) -> tuple[BenchConfig, Sizing]:
    """``config`` with its chat load sized so that the fleet's twin is busy
    ``target_share`` of the time, and what was found; the calibration in ``out``."""
    check_size_load(target_share, config.workload)
    profile = config.replay_profile
    twin = fleet.replay_config(profile)
    if twin is None:  # engines not ours, untimed: time one
        profile = str(calibrate_engine(fleet, out / "calibration"))
        twin = fleet.replay_config(profile)
    if twin is None:
        raise ValueError(
            "--size-load: the fleet has no twin to size its load on (its replicas are "
            "neither ours nor behind our gateway)"
        )
    chat = config.chat_config()
    window_s = chat["num_sessions"] / chat["session_rate"]  # how long sessions arrive
    tokenizer = (
        load_tokenizer(*fleet.tokenizer) if fleet.tokenizer[0] != DEFAULT_TOKENIZER else None
    )

    def load_at(rate: float) -> Workload:
        sized = _at_rate(config, rate, window_s)
        workload = sized.load()
        return retokenized(workload, tokenizer) if tokenizer else workload

    rate, share = find_rate(load_at, twin, target_share, chat["session_rate"], window_s)
    sized = _at_rate(config, rate, window_s)
    found = Sizing(sized.chat["session_rate"], sized.chat["num_sessions"], share, profile)
    return replace(sized, replay_profile=profile), found


def check_size_load(target_share: float, workload: str) -> None:
    """``ValueError`` if ``--size-load`` cannot size this load (before anything starts)."""
    if not 0 < target_share < 1:
        raise ValueError(f"--size-load {target_share}: a share of the time, in (0, 1)")
    if not workload_kind(workload).chat:
        raise ValueError(
            f"--size-load sizes the chat workload's session rate; {workload} sets its own arrivals"
        )


def calibrate_engine(fleet: Fleet, out: Path) -> Path:
    """Time the fleet's first engine (calibrate's sweep) and write its profile in ``out``."""
    url = next(iter(fleet.replicas))
    print(f"bench: timing the engine at {url} (prefix-router calibrate)…", file=sys.stderr)
    result = asyncio.run(calibrate(CalibrateConfig(url), progress=False, fleet_token=fleet.token))
    print(report(result), file=sys.stderr)
    return write_calibration(result, url, out)


def find_rate(
    load_at: Callable[[float], Workload],
    twin: ReplayConfig,
    target: float,
    rate: float,
    window_s: float,
) -> tuple[float, float]:
    """The session rate at which the twin's engines are busy ``target`` of the time,
    and that share: the rate doubled or halved until the share lies between two tries,
    then bisected (geometrically) between them. The share grows with the rate, though
    not smoothly (a workload of more sessions is another draw of sessions), so the
    closest try wins once close enough or out of tries."""
    tries = {rate: busy_share(load_at(rate), twin, window_s)}
    low, high = (0.0, rate) if tries[rate] > target else (rate, math.inf)
    for _ in range(MAX_TRIES - 1):
        _, share = min(tries.items(), key=lambda item: abs(item[1] - target))
        if abs(share - target) <= CLOSE_ENOUGH * target:
            break
        if high == math.inf:
            rate = low * 2
        elif low == 0.0:
            rate = high / 2
        else:
            rate = math.sqrt(low * high)
        tries[rate] = busy_share(load_at(rate), twin, window_s)
        if tries[rate] > target:
            high = rate
        else:
            low = rate
    return min(tries.items(), key=lambda item: abs(item[1] - target))


def busy_share(workload: Workload, twin: ReplayConfig, window_s: float) -> float:
    """The share of each engine's time the workload's work takes, over the ``window_s``
    its sessions arrive in (the offered load: its end, sessions running on after the
    last arrived, is not counted twice): the engines' steps in the replay, and each
    request's time outside them (the server's HTTP and tokenizing, the profile's)."""
    result = replay(workload, twin, SIZING_POLICY)
    request_s = get_profile(twin.profile).request_s * len(result.records)
    busy = sum(engine.busy_s for engine in result.engines) + request_s
    return busy / (len(result.engines) * window_s)


def _at_rate(config: BenchConfig, rate: float, window_s: float) -> BenchConfig:
    chat: dict[str, Any] = {**config.chat, "session_rate": round(rate, 3)}
    chat["num_sessions"] = max(1, round(rate * window_s))
    return replace(config, chat=chat)
