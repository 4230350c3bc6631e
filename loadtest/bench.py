"""``prefix-router bench``: routing policies compared under real HTTP load.

For each policy in turn: reset every replica's cache and statistics, switch the
gateway to the policy, play the same seeded workload with Locust (headless, in its
own process) until every session is done, then collect Locust's figures, the
client's, the replicas' and the gateway's into one row (DESIGN.md section 7). Beside
each live row stands the offline replay's prediction for the same workload and fleet.

Targets: the embedded deployment (default: ``prefix-router serve`` in a subprocess,
stopped at the end), the gateways that ``prefix-router up`` put on a ``ray start``
cluster (``--address auto``), or any gateway or OpenAI-compatible server
(``--gateway URL``). Given several gateways (``--gateways N`` embedded, or several
URLs), each request goes to one of them at random, and every gateway is switched
and counted. The label ``sglang_router`` among the policies of our gateway is a row routed by
SGLang's router (the real binary), started in front of the same replicas for that row
only (against another target, it is only a label).
"""

from __future__ import annotations

import contextlib
import csv
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from tqdm import tqdm

from deploy import processes
from deploy.flags import config_flags
from loadtest import sglang
from loadtest.replay import ReplayConfig, replay
from loadtest.report import ROW_KEYS, Row, replay_row, tier_figures
from loadtest.timeline import Timeline
from loadtest.workloads import ChatConfig, Workload, load_workload
from replica.api import stats as stats_codec
from replica.api.config import ReplicaConfig
from replica.api.figures import EngineFigures, read_figures
from replica.api.identity import DEFAULT_MODEL
from replica.api.stats import ReplicaStats
from router.latency import percentile
from router.policies import POLICIES
from router.stats import GatewayStats

LOCUSTFILE = Path(__file__).with_name("locustfile.py")

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
#: A live hit rate further than this from the replay's prediction is flagged.
REPLAY_TOLERANCE = 0.05


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
    progress: bool = True

    def chat_config(self) -> dict[str, Any]:
        return {**BENCH_CHAT, **self.chat, "seed": self.seed}

    def load(self) -> Workload:
        if self.workload == "chat":
            return load_workload(self.workload, self.chat_config())
        return load_workload(self.workload, {"limit": self.trace_limit} if self.trace_limit else {})


# ------------------------------------------------------------------- targets


@contextlib.contextmanager
def embedded(
    replicas: int, serve_flags: Sequence[str] = (), gateways: int = 1, timeout_s: float = 600.0
) -> Iterator[list[str]]:
    """``prefix-router serve`` (local Ray, N replica actors, gateways on consecutive
    ports) for the bench; the gateways' URLs, once each has checked every replica."""
    port = processes.free_ports(gateways)
    command = ["serve", "--replicas", str(replicas), "--gateways", str(gateways),
               "--separate-ports", *serve_flags]  # fmt: skip
    process = processes.start(command, port)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(gateways)]

    def ready(answer: httpx.Response) -> bool:
        backends = answer.json()["backends"] if answer.status_code == 200 else []
        return len(backends) == replicas and all(b["routing_mode"] != "checking" for b in backends)

    try:
        for url in urls:
            processes.wait_until(url, process, ready, path="/stats", timeout_s=timeout_s)
        yield urls
    finally:
        processes.stop(process)


def cluster_gateways(address: str) -> list[str]:
    """The URLs of the gateways ``prefix-router up`` deployed on the cluster at ``address``."""
    import ray

    from deploy import cluster

    cluster.connect(address)
    try:
        gateways, _ = cluster.status()
    finally:
        ray.shutdown()
    if not gateways:
        raise ValueError(f"no prefix-router gateway on the cluster at {address}: run `up` first")
    return sorted({row.url for row in gateways})  # gateways sharing a node's port: one URL


@dataclass
class Fleet:
    """What the bench knows of its target: the (first) gateway's stats if they are ours
    (they can switch policy and name their replicas), and each replica's configuration
    by URL (``None`` for a server that is not one of ours)."""

    gateways: list[str]
    stats: GatewayStats | None
    replicas: dict[str, ReplicaConfig | None]

    @property
    def gateway(self) -> str:
        return self.gateways[0]

    @property
    def ours(self) -> bool:
        return self.stats is not None

    def behind(self, router: str) -> Fleet:
        """The same replicas, reached through another router (which we cannot switch)."""
        return Fleet([router], None, self.replicas)

    def replay_config(self) -> ReplayConfig | None:
        """The simulated twin of the fleet, if every replica is one of ours: the same
        engines, routed with the very knobs the gateway routes with."""
        configs = list(self.replicas.values())
        first = configs[0] if configs else None
        if first is None or not all(configs):
            return None
        routing = self.stats.config.routing if self.stats else ReplayConfig().routing
        return ReplayConfig(
            replicas=len(configs),
            capacity_blocks=first.num_blocks,
            profile=first.profile,
            max_num_seqs=first.max_num_seqs,
            max_num_batched_tokens=first.max_num_batched_tokens,
            model=first.model,
            host_blocks=first.host_blocks,
            host_link=first.host_link,
            routing=replace(routing, block_size=first.block_size),
            compute_scale=first.speedup,  # simulated time runs this much faster
        )


def discover(client: httpx.Client, gateways: list[str], checks_s: float = 120.0) -> Fleet:
    """What the target is; our gateways once they have checked every replica (a check's
    canary prompt, answered during a run, would count in it)."""
    for url in gateways:
        check_reachable(client, url)
    every = [gateway_stats(client, url) for url in gateways]
    stats = every[0]
    if stats is None or None in every:  # not ours: servers (ours, vLLM, SGLang) or routers
        return Fleet(gateways, None, {url: _replica_config(client, url) for url in gateways})
    deadline = time.monotonic() + checks_s
    while any(b.routing_mode == "checking" for g in every if g for b in g.backends):
        if time.monotonic() > deadline:
            print("warning: a gateway is still checking its replicas", file=sys.stderr)
            break
        time.sleep(0.2)
        every = [gateway_stats(client, url) for url in gateways]
    stats = every[0] or stats
    urls = [b.url for b in stats.backends]
    return Fleet(gateways, stats, {url: _replica_config(client, url) for url in urls})


def check_reachable(client: httpx.Client, url: str) -> None:
    """Any answer will do (a router may have no ``/health``); no answer is an error."""
    try:
        client.get(f"{url}/health", timeout=10.0)
    except httpx.HTTPError as error:
        raise ValueError(f"cannot reach {url} ({type(error).__name__}: {error}): is it "
                         "running, and is that its URL?") from None  # fmt: skip


def gateway_stats(client: httpx.Client, url: str) -> GatewayStats | None:
    """A prefix-router gateway's ``/stats``; ``None`` if ``url`` is not one."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        return stats_codec.decode(GatewayStats, client.get(f"{url}/stats").content)
    return None


def replica_stats(client: httpx.Client, url: str) -> ReplicaStats | None:
    """One of our replicas' ``/stats``; ``None`` if ``url`` is not one."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        return stats_codec.decode(ReplicaStats, client.get(f"{url}/stats").content)
    return None


def _replica_config(client: httpx.Client, url: str) -> ReplicaConfig | None:
    stats = replica_stats(client, url)
    return stats.config if stats else None


# ------------------------------------------------------------------- one run


def reset(client: httpx.Client, fleet: Fleet, timeout_s: float = 120.0) -> bool:
    """Empty every replica's cache (and our replicas' statistics); True if all did.

    Ours answer ``POST /reset`` (409 while requests are in flight), vLLM
    ``/reset_prefix_cache`` (``{"success": false}`` while blocks are held), SGLang
    ``/flush_cache``; a busy replica is asked again until ``timeout_s``.
    """
    done = []
    for url in fleet.replicas:
        deadline = time.monotonic() + timeout_s
        outcome = _reset(client, url)
        while outcome is False and time.monotonic() < deadline:
            time.sleep(0.5)
            outcome = _reset(client, url)
        done.append(bool(outcome))
    return bool(done) and all(done)


def _reset(client: httpx.Client, url: str) -> bool | None:
    """True: emptied; False: busy, ask again; None: it cannot be emptied."""
    answer = _post(client, f"{url}/reset")
    if answer is None or answer.status_code not in (404, 405):
        return None if answer is None else {200: True, 409: False}.get(answer.status_code)
    vllm = _post(client, f"{url}/reset_prefix_cache")
    if vllm is not None and vllm.status_code == 200:
        with contextlib.suppress(ValueError):
            return bool(vllm.json().get("success", True))
        return True
    sglang = _post(client, f"{url}/flush_cache")
    return True if sglang is not None and sglang.status_code == 200 else None


def _post(client: httpx.Client, url: str) -> httpx.Response | None:
    try:
        return client.post(url)
    except httpx.HTTPError:
        return None


def switch_policy(client: httpx.Client, fleet: Fleet, policy: str) -> None:
    for gateway in fleet.gateways:
        response = client.post(f"{gateway}/admin/policy", json={"policy": policy})
        if response.status_code != 200:
            raise ValueError(f"gateway {gateway} refused policy {policy!r}: {response.text}")


@dataclass
class LocustRun:
    """Locust's and the client's figures of one run."""

    requests: int
    failures: int
    elapsed_s: float
    client: dict[str, Any]
    cpu_busy: float
    cpu_busy_peak: float
    timeline: Timeline


def locust_command(config: BenchConfig, gateways: list[str], prefix: Path) -> list[str]:
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "-u", str(config.users), "-r", str(config.users), "-t", f"{config.run_time_s:.0f}s",
        "--host", gateways[0], "--gateways", ",".join(gateways),
        "--csv", str(prefix), "--results-file", f"{prefix}_client.json",
        "--only-summary", "--loglevel", "WARNING", "--stop-timeout", "10",
        "--workload", config.workload, "--workload-seed", str(config.seed),
        "--model", config.model,
    ]  # fmt: skip
    if config.trace_limit:
        command += ["--trace-limit", str(config.trace_limit)]
    if config.workload == "chat":
        chat = config.chat_config()
        command += ["--arrival-rate", str(chat.get("session_rate", ChatConfig().session_rate))]
        command += config_flags({k: v for k, v in chat.items() if k != "seed"}, prefix="chat-")
    return command


def run_locust(
    config: BenchConfig, fleet: Fleet, prefix: Path, total: int, label: str
) -> LocustRun:
    """Locust in its own process (gevent wants one); a progress bar fed by the fleet, whose
    replicas are sampled every second for the charts over time."""
    log = prefix.with_name(prefix.name + "_locust.log")
    psutil.cpu_percent()  # starts the measuring interval
    started = time.monotonic()
    timeline = Timeline(start=time.time())
    samples: list[float] = []
    with (
        open(log, "w") as output,
        tqdm(total=total, desc=label, unit="req", disable=not config.progress) as bar,
        httpx.Client(timeout=5.0) as client,
    ):
        process = subprocess.Popen(
            locust_command(config, fleet.gateways, prefix), stdout=output, stderr=output
        )
        seen = _dispatched(client, fleet)
        while process.poll() is None:
            samples.append(psutil.cpu_percent(interval=1.0) / 100)
            replicas = _replicas_now(client, fleet)
            timeline.sample(time.time(), replicas)
            now = _dispatched(client, fleet, replicas)
            bar.update(max(now - seen, 0))
            seen = now
    elapsed = time.monotonic() - started
    if process.returncode not in (0, 1):  # 1: some requests failed, which the row shows
        raise RuntimeError(f"locust exited with {process.returncode}: {log.read_text()[-2000:]}")
    requests, failures = _locust_counts(Path(f"{prefix}_stats.csv"))
    client_figures = json.loads(Path(f"{prefix}_client.json").read_text())
    timeline.add_answers(client_figures.pop("answers", []))
    busy = float(np.mean(samples)) if samples else 0.0
    peak = max(samples, default=0.0)
    return LocustRun(requests, failures, elapsed, client_figures, busy, peak, timeline)


def engine_figures(client: httpx.Client, fleet: Fleet) -> dict[str, EngineFigures]:
    """What each replica counted (ours or vLLM), by URL; those that did not answer left out."""
    figures = {}
    for url in fleet.replicas:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            figures[url] = read_figures(client, url)
    return figures


def _replicas_now(client: httpx.Client, fleet: Fleet) -> list[ReplicaStats]:
    """Every replica's stats, or none if one did not answer (a sample is all or nothing)."""
    every = [replica_stats(client, url) for url, config in fleet.replicas.items() if config]
    return [r for r in every if r is not None] if None not in every else []


def _dispatched(client: httpx.Client, fleet: Fleet, replicas: Sequence[ReplicaStats] = ()) -> int:
    """Requests sent so far: our gateways count them; behind another router, the
    replicas do (ours since their reset, vLLM since it started)."""
    if not fleet.ours:
        if replicas:
            return sum(r.requests for r in replicas)
        return sum(f.requests for f in engine_figures(client, fleet).values())
    every = [gateway_stats(client, url) for url in fleet.gateways]
    return sum(b.dispatched for stats in every if stats for b in stats.backends)


def _locust_counts(path: Path) -> tuple[int, int]:
    """Requests and failures of the real requests (not the TTFT and ITL entries)."""
    with open(path, newline="") as stats:
        rows = [r for r in csv.DictReader(stats) if r["Type"] == "POST"]
    return sum(int(r["Request Count"]) for r in rows), sum(int(r["Failure Count"]) for r in rows)


# ------------------------------------------------------------------- figures


@dataclass(frozen=True)
class Snapshot:
    """The gateways' and the replicas' statistics at one moment (none: not ours), and
    what every replica counted (ours or vLLM: :class:`EngineFigures`), by URL."""

    gateways: list[GatewayStats]
    replicas: list[ReplicaStats]
    engines: dict[str, EngineFigures] = field(default_factory=dict)


def snapshot(client: httpx.Client, fleet: Fleet) -> Snapshot:
    gateways = [gateway_stats(client, url) for url in fleet.gateways] if fleet.ours else []
    replicas = [replica_stats(client, url) for url, config in fleet.replicas.items() if config]
    return Snapshot(
        [g for g in gateways if g], [r for r in replicas if r is not None],
        engine_figures(client, fleet),
    )  # fmt: skip


def live_row(
    policy: str,
    config: BenchConfig,
    fleet: Fleet,
    run: LocustRun,
    before: Snapshot,
    after: Snapshot,
) -> Row:
    counted = _engine_counts(before, after)
    per_replica = (
        [r.requests for r in after.replicas]
        or [f.requests for f in counted.values()]
        or _gateway_requests(before, after)
    )
    client = run.client
    ttft, e2e = client.get("ttft_s", []), client.get("e2e_s", [])
    first = next((c for c in fleet.replicas.values() if c), None)
    row: Row = dict.fromkeys(ROW_KEYS)
    row.update(
        label=policy,
        policy=policy if fleet.ours else None,  # else a label for how the target routes
        workload=config.workload,
        replicas=len(fleet.replicas) if fleet.ours else (len(after.replicas) or None),
        capacity_blocks=first.num_blocks if first else None,
        requests=run.requests,
        failures=run.failures,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p90_s=percentile(ttft, 90),
        ttft_p99_s=percentile(ttft, 99),
        e2e_p50_s=percentile(e2e, 50),
        throughput_rps=run.requests / run.elapsed_s,
        imbalance=max(per_replica) / np.mean(per_replica) if sum(per_replica) else None,
        prediction_accuracy=live_prediction_accuracy(before, after, policy),
        **prediction_shares(before, after, policy),
        requests_per_replica=per_replica,
        requests_per_gateway=_requests_per_gateway(before, after),
        client_token_hit_rate=client.get("client_token_hit_rate"),
        client_prompt_tokens=client.get("prompt_tokens"),
        client_cached_tokens=client.get("cached_tokens"),
        late_session_starts=client.get("late_session_starts"),
        duration_s=run.elapsed_s,
        cpu_busy=run.cpu_busy,
        cpu_busy_peak=run.cpu_busy_peak,
    )
    if after.replicas:
        row.update(_hit_figures(after.replicas))
    elif counted:
        row.update(_engine_hit_figures(list(counted.values())))
    else:
        row.update(_client_hit_figures(client))
    row.update(_event_latency(after))
    return row


def _event_latency(snap: Snapshot) -> Row:
    """How long the replicas' KV events took to reach the gateways' indexes: the median
    of the streams' medians and the worst stream's p99 (over each gateway's last
    10,000 batches per replica: the transport's figure, not the policy's)."""
    streams = [b.kv_stream for g in snap.gateways for b in g.backends if b.kv_stream]
    p50s = [s.latency_p50_s for s in streams if s.latency_p50_s is not None]
    p99s = [s.latency_p99_s for s in streams if s.latency_p99_s is not None]
    return {
        "kv_event_latency_p50_s": float(np.median(p50s)) if p50s else None,
        "kv_event_latency_p99_s": max(p99s) if p99s else None,
    }


def _hit_figures(replicas: list[ReplicaStats]) -> Row:
    """Hits as the engines counted them (their statistics were reset before the run)."""
    caches = [r.cache for r in replicas]
    prompt, cached = sum(c.query_tokens for c in caches), sum(c.hit_tokens for c in caches)
    blocks = sum(c.query_blocks for c in caches)
    host_hits = sum(c.host_hit_tokens for c in caches)
    to_host, to_gpu = sum(c.bytes_to_host for c in caches), sum(c.bytes_to_gpu for c in caches)
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_hit_rate": cached / prompt if prompt else None,
        "block_hit_rate": sum(c.hit_blocks for c in caches) / blocks if blocks else None,
        "evictions": sum(c.evictions for c in caches),
        **tier_figures(prompt, cached, host_hits, to_host, to_gpu),
    }


def _engine_counts(before: Snapshot, after: Snapshot) -> dict[str, EngineFigures]:
    """What each replica counted during the run (vLLM's counters never reset), when
    every replica answered both times."""
    if not after.engines or set(after.engines) != set(before.engines):
        return {}
    return {url: now.since(before.engines[url]) for url, now in after.engines.items()}


def _engine_hit_figures(counted: list[EngineFigures]) -> Row:
    """Hits as the engines counted them (vLLM: its prefix cache's counters)."""
    prompt, cached = sum(f.query_tokens for f in counted), sum(f.hit_tokens for f in counted)
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_hit_rate": cached / prompt if prompt else None,
    }


def _client_hit_figures(client: dict[str, Any]) -> Row:
    """Not our replicas: the usage blocks the clients read are all there is."""
    return {
        "prompt_tokens": client.get("prompt_tokens"),
        "cached_tokens": client.get("cached_tokens"),
        "token_hit_rate": client.get("client_token_hit_rate"),
    }


def _gateway_requests(before: Snapshot, after: Snapshot) -> list[int]:
    """Requests the gateways sent each replica during the run."""

    def by_replica(snap: Snapshot) -> Counter[str]:
        counts: Counter[str] = Counter()
        for gateway in snap.gateways:  # each gateway counts what it sent
            for backend in gateway.backends:
                counts[backend.replica_id] += backend.dispatched
        return counts

    now, then = by_replica(after), by_replica(before)
    return [now[replica] - then[replica] for replica in sorted(now)]


def _requests_per_gateway(before: Snapshot, after: Snapshot) -> list[int] | None:
    """Requests each of our gateways routed during the run (by process: the gateways
    of one deployment may share a port)."""
    if not after.gateways:
        return None
    then = {g.pid: sum(b.dispatched for b in g.backends) for g in before.gateways}
    return [sum(b.dispatched for b in g.backends) - then.get(g.pid, 0) for g in after.gateways]


def prediction_shares(before: Snapshot, after: Snapshot, policy: str) -> Row:
    """Of this run's predictions: the share the engines' figures matched exactly, those
    within one KV block, and those that predicted more cached tokens than were found."""
    keys = ("prediction_exact", "prediction_within_block", "prediction_over")
    if not before.gateways or not after.gateways:
        return dict.fromkeys(keys)

    def counts(snap: Snapshot) -> list[int]:
        every = [c for g in snap.gateways for c in g.by_policy(policy)]
        fields = ("predictions", "exact_predictions", "block_predictions", "over_predictions")
        return [sum(getattr(c, name) for c in every) for name in fields]

    made, *shares = (now - then for now, then in zip(counts(after), counts(before), strict=True))
    return {
        key: share / made if made > 0 else None for key, share in zip(keys, shares, strict=True)
    }


def live_prediction_accuracy(before: Snapshot, after: Snapshot, policy: str) -> float | None:
    """Share of this run's predictions within one router stride of the engine's figure."""
    if not before.gateways or not after.gateways:
        return None

    def counts(snap: Snapshot) -> tuple[int, int]:
        every = [c for g in snap.gateways for c in g.by_policy(policy)]
        return sum(c.predictions for c in every), sum(c.close_predictions for c in every)

    (made_then, close_then), (made_now, close_now) = counts(before), counts(after)
    made = made_now - made_then
    return (close_now - close_then) / made if made > 0 else None


def predict(config: BenchConfig, fleet: Fleet, policy: str, workload: Workload) -> Row | None:
    """The offline replay of the same workload on the fleet's simulated twin."""
    twin = fleet.replay_config()
    if twin is None:
        return None
    if policy == sglang.LABEL:  # SGLang's router: our re-implementation of its algorithm
        policy = sglang.REPLAYED_AS
    elif policy not in POLICIES:  # a label: only a lone server is predictable, any policy
        if twin.replicas > 1:
            return None
        policy = "round_robin"
    return replay_row(replay(workload, replace(twin, seed=config.seed), policy))


def add_prediction(row: Row, predicted: Row | None) -> None:
    """The replay's figures beside the live ones, flagged if the hit rates part."""
    live = row.get("token_hit_rate")
    expected = predicted["token_hit_rate"] if predicted else None
    row.update(
        replay_token_hit_rate=expected,
        replay_ttft_p50_s=predicted["ttft_p50_s"] if predicted else None,
        replay_ttft_p99_s=predicted["ttft_p99_s"] if predicted else None,
        replay_imbalance=predicted["imbalance"] if predicted else None,
        replay_differs=(
            abs(live - expected) > REPLAY_TOLERANCE
            if live is not None and expected is not None
            else None
        ),
    )


# ------------------------------------------------------------------- the comparison


def compare(
    config: BenchConfig, gateways: list[str], out: Path
) -> tuple[list[Row], Fleet, dict[str, Timeline]]:
    """Every policy in turn against ``gateways``; one row each, with the replay's view,
    and each run's timeline."""
    out.mkdir(parents=True, exist_ok=True)
    workload = config.load()
    with httpx.Client(timeout=30.0) as client:
        fleet = discover(client, gateways)
        check_target(config, fleet)
        announce(fleet)
        rows, timelines = [], {}
        for label in config.policies:
            if label == sglang.LABEL and fleet.ours:  # else the target is theirs already
                row, run = run_behind_sglang(client, config, fleet, workload, out)
            else:
                row, run = run_policy(client, config, fleet, label, workload, out)
            rows.append(row)
            timelines[label] = run.timeline
    for row in rows:
        predicted = predict(config, fleet, row["label"], workload) if config.predict else None
        add_prediction(row, predicted)
    return rows, fleet, timelines


def check_target(config: BenchConfig, fleet: Fleet) -> None:
    if not fleet.ours and len(config.policies) > 1:
        raise ValueError(
            f"{', '.join(fleet.gateways)}: not a prefix-router gateway, so the bench cannot "
            "switch its policy: pass one --policies NAME, a label for how it routes"
        )


def announce(fleet: Fleet) -> None:
    """Where to watch the run live: each of our gateways serves its dashboard."""
    for gateway in fleet.gateways if fleet.ours else []:
        print(f"bench: live dashboard at {gateway}/dashboard", file=sys.stderr)


def run_policy(
    client: httpx.Client,
    config: BenchConfig,
    fleet: Fleet,
    label: str,
    workload: Workload,
    out: Path,
) -> tuple[Row, LocustRun]:
    """One live run: empty every cache, switch our gateways (if ours), play the workload."""
    if not reset(client, fleet):
        print(f"warning: could not reset every replica's cache before {label}", file=sys.stderr)
    if fleet.ours:
        switch_policy(client, fleet, label)
    before = snapshot(client, fleet)
    run = run_locust(config, fleet, out / label, workload.num_requests, label)
    return live_row(label, config, fleet, run, before, snapshot(client, fleet)), run


def run_behind_sglang(
    client: httpx.Client, config: BenchConfig, fleet: Fleet, workload: Workload, out: Path
) -> tuple[Row, LocustRun]:
    """The same run with SGLang's router in front of the same replicas, started for
    this row and stopped after it (an error included)."""
    workers = list(fleet.replicas)
    print(f"bench: starting SGLang's router in front of {len(workers)} replicas…", file=sys.stderr)
    with sglang.sglang_router(workers, log=out / f"{sglang.LABEL}.log") as router:
        return run_policy(client, config, fleet.behind(router), sglang.LABEL, workload, out)
