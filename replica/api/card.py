"""What an engine replica says of itself, so that a gateway configures itself from it.

A gateway must hash prompts as the engine caches them: the same block size, the same
tokenizer, the same model. Rather than flags a user must match by hand, every replica
describes itself in an :class:`EngineCard`: ours from their ``/stats``, a vLLM server
from its ``/metrics`` (``vllm:cache_config_info`` names its block size and pool) and
``/v1/models``, and a replica actor hands its card to the gateways following it. What
a card leaves out (``None``) the gateway does not know and does not assume.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from replica.api.stats import KVEventsEndpoint, ReplicaStats

#: vLLM's header that pins a request to one of a server's data-parallel engines.
RANK_HEADER = "x-data-parallel-rank"


@dataclass(frozen=True)
class EngineCard:
    """One replica: where it serves, what it serves, and how it caches."""

    #: Its engine kind's name (``replica/api/engines.py``).
    engine: str
    url: str
    #: The name requests give as ``model`` (vLLM's served model name).
    model: str
    block_size: int | None
    #: KV blocks in its pool (its cache's capacity).
    num_blocks: int | None = None
    #: Its tokenizer: ``bytes4`` (the simulated model's) or a model folder's path.
    tokenizer: str | None = None
    #: Where it pushes its KV events (``None``: it publishes none that we know of).
    kv_events: KVEventsEndpoint | None = None
    #: The engine's process, for operators (and tests that stop it).
    pid: int | None = None
    #: The LoRA adapters it serves on top of ``model`` (requests name one as their model).
    adapters: tuple[str, ...] = ()
    #: Leaving the fleet (a scale-in): gateways send it nothing new, and it stops once
    #: the requests it holds have ended (deploy/scaler.py).
    draining: bool = False
    #: What it does in a disaggregated fleet: ``both``, ``prefill`` or ``decode``.
    role: str = "both"
    #: The most tokens a request may hold, prompt and answer (vLLM's ``max_model_len``;
    #: ours: its KV cache's), ``None`` where it does not say.
    max_model_len: int | None = None
    #: Engines behind its URL, each with a KV cache of its own (vLLM's
    #: ``--data-parallel-size``): a request picks one with ``X-data-parallel-rank``, and
    #: rank R publishes its KV events where rank 0 does, its ports plus R.
    data_parallel_size: int = 1
    #: The most requests its engine runs at once (vLLM's ``max_num_seqs``, which its
    #: server does not publish: ``None``); more wait in the engine's own queue.
    max_num_seqs: int | None = None


def sim_card(url: str, stats: ReplicaStats) -> EngineCard:
    """One of our simulated replicas, from its ``/stats``."""
    config = stats.config
    return EngineCard(
        "sim",
        url,
        config.model,
        config.block_size,
        stats.cache.num_blocks,
        config.tokenizer,
        stats.kv_events,
        stats.pid,
        tuple(stats.adapters),
        role=config.role,
        max_model_len=stats.cache.num_blocks * config.block_size,
        max_num_seqs=config.max_num_seqs,
        data_parallel_size=config.data_parallel_size,
    )


def vllm_cache_config(metrics_text: str) -> dict[str, str]:
    """The labels of vLLM's ``vllm:cache_config_info`` gauge (its ``CacheConfig``:
    ``block_size``, ``num_gpu_blocks``, ...), or ``{}`` if the text has none."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "vllm:cache_config_info":
            return dict(family.samples[0].labels) if family.samples else {}
    return {}


def vllm_card(
    url: str,
    metrics_text: str,
    models: Iterable[dict[str, object]],
    kv_events: KVEventsEndpoint | None = None,
    pid: int | None = None,
) -> EngineCard | None:
    """A vLLM server, from its ``/metrics`` text and its ``/v1/models`` cards; ``None``
    if the metrics are not vLLM's."""
    cache = vllm_cache_config(metrics_text)
    if not cache:
        return None
    cards = list(models)
    bases = [card for card in cards if not card.get("parent")]  # adapters name their parent
    first = bases[0] if bases else {}
    model = str(first.get("id") or "")
    root = str(first.get("root") or model)  # the folder it loaded (its tokenizer's)
    adapters = tuple(str(card["id"]) for card in cards if card.get("parent") and card.get("id"))
    return EngineCard(
        "vllm",
        url,
        model,
        _int(cache.get("block_size")),
        _int(cache.get("num_gpu_blocks")),
        root or None,
        kv_events,
        pid,
        adapters,
        max_model_len=_int(str(first.get("max_model_len") or "")),
        data_parallel_size=len(vllm_engines(metrics_text)) or 1,
    )


def vllm_engines(metrics_text: str) -> set[str]:
    """The engines a vLLM server's ``/metrics`` reports (its data-parallel ranks)."""
    families = text_string_to_metric_families(metrics_text)
    samples = (s for f in families if f.name == "vllm:cache_config_info" for s in f.samples)
    return {sample.labels["engine"] for sample in samples if sample.labels.get("engine")}


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None
