"""Where the bench points and what it finds there: an embedded deployment, a
cluster's gateways or any URL; our gateways and replicas read through their ``/stats``,
any engine's counters through its ``/metrics``."""

from __future__ import annotations

import contextlib
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import httpx

from deploy import processes
from loadtest.replay import ReplayConfig
from replica.api import stats as stats_codec
from replica.api.config import ReplicaConfig
from replica.api.engines import read_figures
from replica.api.figures import EngineFigures
from replica.api.fleet_token import ENV_FLEET_TOKEN
from replica.api.stats import ReplicaStats
from replica.api.tokenizer import DEFAULT_TOKENIZER
from router.stats import GatewayStats


@contextlib.contextmanager
def embedded(
    replicas: int, serve_flags: Sequence[str] = (), gateways: int = 1, timeout_s: float = 600.0
) -> Iterator[tuple[list[str], str]]:
    """``prefix-router serve`` (local Ray, N replica actors, gateways on consecutive
    ports) for the bench; the gateways' URLs, once each has checked every replica, and
    the fleet's token (the bench's own: it reads and empties the replicas)."""
    port = processes.free_ports(gateways)
    command = ["serve", "--replicas", str(replicas), "--gateways", str(gateways)]
    command += ["--separate-ports", *serve_flags]
    token = secrets.token_urlsafe(32)
    process = processes.start(command, port, env={ENV_FLEET_TOKEN: token})
    urls = [f"http://127.0.0.1:{port + i}" for i in range(gateways)]

    def ready(answer: httpx.Response) -> bool:
        backends = answer.json()["backends"] if answer.status_code == 200 else []
        servers = {b.get("server") or b["replica_id"] for b in backends}  # a server's ranks: one
        return len(servers) == replicas and all(b["routing_mode"] != "checking" for b in backends)

    try:
        for url in urls:
            processes.wait_until(url, process, ready, path="/stats", timeout_s=timeout_s)
        yield urls, token
    finally:
        processes.stop(process)


def cluster_gateways(address: str) -> tuple[list[str], str]:
    """The URLs of the gateways ``prefix-router up`` deployed on the cluster at
    ``address``, and the fleet's token (from them, through Ray)."""
    import ray

    from deploy import cluster
    from deploy.gateways import running_credentials

    cluster.connect(address)
    try:
        gateways, _ = cluster.status()
        credentials = running_credentials()
    finally:
        ray.shutdown()
    if not gateways or credentials is None:
        raise ValueError(f"no prefix-router gateway on the cluster at {address}: run `up` first")
    # gateways sharing a node's port: one URL
    return sorted({row.url for row in gateways}), credentials.token


@dataclass
class Fleet:
    """What the bench knows of its target: the (first) gateway's stats if they are ours
    (they can switch policy and name their replicas), and each replica's configuration
    by URL (``None`` for a server that is not one of ours)."""

    gateways: list[str]
    stats: GatewayStats | None
    replicas: dict[str, ReplicaConfig | None]
    #: The fleet's token, that its replicas ask of callers (empty: none).
    token: str = field(default="", repr=False)
    #: What the target asks of clients as a bearer token: another router started in
    #: front of the replicas with the fleet's token (``--api-key``) asks for it too.
    api_key: str = field(default="", repr=False)

    @property
    def gateway(self) -> str:
        return self.gateways[0]

    @property
    def ours(self) -> bool:
        return self.stats is not None

    def behind(self, router: str) -> Fleet:
        """The same replicas, reached through another router (which we cannot switch),
        that holds the fleet's token and asks it of its clients."""
        return Fleet([router], None, self.replicas, self.token, api_key=self.token)

    def replay_config(self, profile: str = "") -> ReplayConfig | None:
        """The simulated twin of the fleet: the same engines, routed with the very knobs
        the gateway routes with. Engines of ours are copied; others (vLLM) are timed by
        ``profile`` (``prefix-router calibrate`` writes one) behind our gateway, or not
        predicted."""
        configs = list(self.replicas.values())
        first = configs[0] if configs else None
        if first is None or not all(configs):
            return self._engines_twin(profile) if profile else None
        routing = self.stats.config.routing if self.stats else ReplayConfig().routing
        # a replica of several data-parallel engines is that many replicas to the twin
        engines = [c for c in configs if c for _ in range(c.data_parallel_size)]
        prefill, decode = _pd_split([c.role for c in engines])
        return ReplayConfig(
            replicas=len(engines),
            capacity_blocks=first.num_blocks,
            profile=first.profile,
            max_num_seqs=first.max_num_seqs,
            max_num_batched_tokens=first.max_num_batched_tokens,
            model=first.model,
            host_blocks=first.host_blocks,
            host_link=first.host_link,
            routing=replace(routing, block_size=first.block_size),
            compute_scale=first.speedup,  # simulated time runs this much faster
            fleet=_models_fleet([c.model for c in engines]),
            max_loras=first.max_loras,
            prefill=prefill,
            decode=decode,
            kv_hold_s=first.kv_hold_s,
        )

    def by_role(self, role: str) -> list[str]:
        """The URLs of the replicas in ``role``, as our gateway knows them (from their
        cards, or as it was told), else as our replicas say."""
        if self.stats is not None:
            return [b.url for b in self.stats.backends if b.role == role]
        return [url for url, config in self.replicas.items() if config and config.role == role]

    def _engines_twin(self, profile: str) -> ReplayConfig | None:
        """vLLM servers behind our gateway, as simulated engines timed by ``profile``,
        with its KV capacity (as calibrated) and vLLM's CPU scheduler limits."""
        if self.stats is None or not self.stats.backends:
            return None
        sizes = {b.block_size for b in self.stats.backends}
        block_size = sizes.pop() if len(sizes) == 1 else None
        if block_size is None:  # unknown, or several: no one twin
            return None
        config = self.stats.config
        prefill, decode = _pd_split([b.role for b in self.stats.backends])
        return ReplayConfig(
            replicas=len(self.stats.backends),
            prefill=prefill,
            decode=decode,
            profile=profile,
            max_num_seqs=VLLM_CPU_MAX_NUM_SEQS,
            max_num_batched_tokens=VLLM_CPU_MAX_NUM_BATCHED_TOKENS,
            model=config.model,
            host_blocks=0,
            routing=replace(config.routing, block_size=block_size),
        )

    @property
    def tokenizer(self) -> tuple[str, str]:
        """The tokenizer (and chat template) the gateway counts tokens with."""
        config = self.stats.config if self.stats else None
        return (config.tokenizer, config.chat_template) if config else (DEFAULT_TOKENIZER, "")


#: vLLM's scheduler limits for its OpenAI server on CPUs (``EngineArgs.get_batch_defaults``
#: in vLLM 0.32): what the twin of a vLLM fleet schedules with.
VLLM_CPU_MAX_NUM_SEQS = 128
VLLM_CPU_MAX_NUM_BATCHED_TOKENS = 2048


def _models_fleet(models: list[str]) -> str:
    """The replayer's ``fleet`` for replicas serving ``models`` ("" for one model)."""
    counts = {model: models.count(model) for model in dict.fromkeys(models)}
    return ",".join(f"{m}={n}" for m, n in counts.items()) if len(counts) > 1 else ""


def discover(
    client: httpx.Client, gateways: list[str], token: str = "", checks_s: float = 120.0
) -> Fleet:
    """What the target is; our gateways once they have checked every replica (a check's
    canary prompt, answered during a run, would count in it). ``token``: the fleet's
    (``client`` carries it)."""
    for url in gateways:
        check_reachable(client, url)
    every = [gateway_stats(client, url) for url in gateways]
    stats = every[0]
    if stats is None or None in every:  # not ours: servers (ours, vLLM, SGLang) or routers
        replicas = {url: replica_config(client, url) for url in gateways}
        return Fleet(gateways, None, replicas, token, api_key=token)
    deadline = time.monotonic() + checks_s
    while any(b.routing_mode == "checking" for g in every if g for b in g.backends):
        if time.monotonic() > deadline:
            print("warning: a gateway is still checking its replicas", file=sys.stderr)
            break
        time.sleep(0.2)
        every = [gateway_stats(client, url) for url in gateways]
    stats = every[0] or stats
    urls = [b.url for b in stats.backends]
    return Fleet(gateways, stats, {url: replica_config(client, url) for url in urls}, token)


def check_reachable(client: httpx.Client, url: str) -> None:
    """Any answer will do (a router may have no ``/health``); no answer is an error."""
    try:
        client.get(f"{url}/health", timeout=10.0)
    except httpx.HTTPError as error:
        why = f"{type(error).__name__}: {error}"
        raise ValueError(
            f"cannot reach {url} ({why}): is it running, and is that its URL?"
        ) from None


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


def replica_config(client: httpx.Client, url: str) -> ReplicaConfig | None:
    stats = replica_stats(client, url)
    return stats.config if stats else None


def engine_figures(client: httpx.Client, fleet: Fleet) -> dict[str, EngineFigures]:
    """What each replica counted (ours or vLLM), by URL; those that did not answer left out."""
    figures = {}
    for url in fleet.replicas:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            figures[url] = read_figures(client, url)
    return figures


def _pd_split(roles: list[str]) -> tuple[int, int]:
    """A twin's prefill and decode replicas from its replicas' roles (0 and 0: an
    aggregated fleet, as one replica that does both makes it)."""
    if "both" in roles:
        return 0, 0
    return roles.count("prefill"), roles.count("decode")
