"""The gateway's configuration: which policy routes, with which knobs, under which limits."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace

from replica.api.card import EngineCard
from replica.api.config import DEFAULT_PROFILE, ReplicaConfig
from replica.api.identity import DEFAULT_MODEL
from replica.api.token_cache import DEFAULT_CACHE_TOKENS
from replica.api.tokenizer import DEFAULT_TOKENIZER
from router.fair.fairness import check_fairness
from router.index.key_cache import DEFAULT_KEY_CACHE_TOKENS
from router.policies import POLICIES, PolicyConfig

#: The longest prompt the gateway reads where neither ``--max-prompt-tokens`` nor any
#: backend's card says: Llama 3.1's context.
DEFAULT_MAX_PROMPT_TOKENS = 131_072


@dataclass(frozen=True)
class DashboardConfig:
    """The live page at ``/dashboard`` and what the gateway keeps for it."""

    #: The page's history: a sample of the counters at most this often, while someone
    #: looks, kept this long (so a reload shows the last minutes again).
    dashboard_sample_s: float = 1.0
    dashboard_history_s: float = 600.0
    #: Per-replica rates (hit rate, decisions per second) are over this window.
    dashboard_window_s: float = 60.0
    #: How long a refresh waits for a replica's ``/stats`` (its cache occupancy).
    dashboard_replica_timeout_s: float = 1.0
    #: Hot prefixes shown, and kept (counted on the request path; see router/index/hot_prefixes.py).
    hot_prefixes_shown: int = 10
    hot_prefixes_kept: int = 1024
    hot_prefix_half_life: int = 4096
    #: Token ids kept of each prefix's first prompt, decoded only for an administrator.
    hot_prefix_sample_tokens: int = 256

    def __post_init__(self) -> None:
        times = (
            self.dashboard_sample_s,
            self.dashboard_history_s,
            self.dashboard_window_s,
            self.dashboard_replica_timeout_s,
        )
        if min(times) <= 0:
            raise ValueError("dashboard_*_s must be positive")
        counts = (self.hot_prefixes_shown, self.hot_prefixes_kept, self.hot_prefix_half_life)
        if min(counts) < 1 or self.hot_prefix_sample_tokens < 0:
            raise ValueError(
                "hot_prefixes_shown, hot_prefixes_kept and hot_prefix_half_life "
                "must be positive, hot_prefix_sample_tokens not negative"
            )


@dataclass(frozen=True)
class GatewayConfig:
    policy: str = "cache_aware"
    #: The model name the replicas serve (it seeds block identities).
    model: str = DEFAULT_MODEL
    #: The replicas' tokenizer, so that the ids hashed are the ones their KV events
    #: carry: ``bytes4`` (the simulated model's) or a Hugging Face ``tokenizer.json`` or
    #: its folder; ``chat_template``: a Jinja file or text replacing the tokenizer's.
    tokenizer: str = DEFAULT_TOKENIZER
    chat_template: str = field(default="", metadata={"derived": "the tokenizer's"})
    #: Another model's tokenizer, as MODEL=TOKENIZER: its requests are tokenized with it
    #: (by default, the one its replicas' cards name where this machine can read it;
    #: router/fleet/tokenizers.py).
    model_tokenizer: tuple[str, ...] = field(default=(), metadata={"metavar": "MODEL=TOKENIZER"})
    #: A Hugging Face tokenizer's cache of chats' pieces between special tokens, in
    #: tokens (0: none): a turn then tokenizes only its new messages
    #: (replica/api/token_cache.py; its size in ``/stats``).
    tokenizer_cache_tokens: int = DEFAULT_CACHE_TOKENS
    #: Recent long prompts' tokens and keys, in tokens (0: none): a conversation's next
    #: turn hashes only its new tokens (router/index/key_cache.py; its size in ``/stats``).
    key_cache_tokens: int = DEFAULT_KEY_CACHE_TOKENS
    #: The policies' knobs, the fleet's block size and the router's stride: the very
    #: object the offline replayer routes with (``ReplayConfig.routing``).
    routing: PolicyConfig = field(default_factory=PolicyConfig)
    #: KV blocks assumed per backend when it does not say (sizes the approximate index).
    capacity_blocks: int = 4096
    #: Check each joining backend: block size, tokenizer, and a canary prompt's KV events
    #: (see router/fleet/backend_check.py); one that disagrees is routed approximately.
    check_backends: bool = True
    kv_events_interval_s: float = 0.05
    #: How often each backend is asked again what it serves (its card: the LoRA adapters
    #: loaded and unloaded at run time); Ray's replicas say it every second anyway.
    describe_interval_s: float = 5.0
    #: Upstream calls: connecting, the longest silence within an answer (a queued
    #: prefill, a slow stream) and the whole answer, in seconds.
    upstream_connect_timeout_s: float = 5.0
    upstream_read_timeout_s: float = 120.0
    upstream_timeout_s: float = 600.0
    seed: int = 0
    #: API keys, one ``KEY TENANT [admin]`` per line (see router/fair/tenants.py); with
    #: ``$PREFIX_ROUTER_API_KEYS``. None configured: no authentication.
    api_keys_file: str = ""
    #: The fleet's secret that tenants' salts are keyed with (router/fair/tenants.py):
    #: a file holding it, else ``$PREFIX_ROUTER_FLEET_SECRET`` (serve and up give one).
    fleet_secret_file: str = ""
    #: The token the replicas ask of their callers (replica/api/fleet_token.py): a file
    #: holding it, else ``$PREFIX_ROUTER_FLEET_TOKEN`` (serve and up give one).
    fleet_token_file: str = ""
    #: Where a request's session key is read: a header's name, or ``user`` (the
    #: request's ``user`` field); empty: nowhere. Routers that learn from their own
    #: decisions send a session's turns to one replica by it (cache_aware).
    session_key: str = "x-session-id"
    #: Requests in flight per replica; beyond it requests wait in the gateway's queue.
    max_outstanding_per_replica: int = 128
    #: Requests that may wait for a free replica, and for how long; beyond: 429.
    max_queued: int = 512
    queue_timeout_s: float = 30.0
    #: Who goes next from that queue (router/fair/fairness.py): ``prefill`` charges each
    #: tenant the prefill it caused and generated tokens, ``vtc`` every token, ``fcfs``
    #: none (first come, first served); request classes go first in all three.
    fairness: str = "prefill"
    #: How long a tenant's service counts against it: it halves every this many
    #: seconds (0: for ever, with VTC's lift of a tenant back from idle).
    fair_half_life_s: float = 30.0
    #: Slots per replica that a tenant holding more than its share of the fleet's
    #: slots may not take (router/fair/fairness.py): free for a lighter tenant's next
    #: request, so that it does not wait for a flood's to end. At most all but one.
    fair_reserve_per_replica: int = 2
    #: Requests that a tenant holding more than its share may leave waiting in an
    #: engine's own queue (router/fair/slots.py): past them, its requests wait in the
    #: gateway's fair queue even below the cap. 0: engines' queues are not asked.
    max_engine_waiting: int = 4
    #: The largest request body accepted (413 beyond).
    max_request_bytes: int = 16 * 2**20
    #: The longest prompt accepted (413 beyond); 0: the longest any backend serves, as
    #: its card says (vLLM's max_model_len, our replicas' KV capacity), where none says
    #: Llama 3.1's context.
    max_prompt_tokens: int = field(
        default=0, metadata={"derived": "the longest the backends serve, else 131072"}
    )
    #: Tries on other replicas when one fails before the client got a byte.
    max_retries: int = 2
    retry_backoff_s: float = 0.05
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        _at_least(
            1,
            capacity_blocks=self.capacity_blocks,
            max_outstanding_per_replica=self.max_outstanding_per_replica,
            max_request_bytes=self.max_request_bytes,
        )
        _at_least(
            0,
            max_queued=self.max_queued,
            max_engine_waiting=self.max_engine_waiting,
            max_retries=self.max_retries,
            retry_backoff_s=self.retry_backoff_s,
            max_prompt_tokens=self.max_prompt_tokens,
            tokenizer_cache_tokens=self.tokenizer_cache_tokens,
            key_cache_tokens=self.key_cache_tokens,
        )
        _positive(
            kv_events_interval_s=self.kv_events_interval_s,
            describe_interval_s=self.describe_interval_s,
            upstream_connect_timeout_s=self.upstream_connect_timeout_s,
            upstream_read_timeout_s=self.upstream_read_timeout_s,
            upstream_timeout_s=self.upstream_timeout_s,
            queue_timeout_s=self.queue_timeout_s,
        )
        check_fairness(self.fairness)
        self.named_tokenizers()  # refused at start if malformed
        _at_least(
            0,
            fair_half_life_s=self.fair_half_life_s,
            fair_reserve_per_replica=self.fair_reserve_per_replica,
        )
        if self.routing.model != self.model:  # one model: the routing knobs follow it
            object.__setattr__(self, "routing", replace(self.routing, model=self.model))
        # seconds are priced as the simulated replica runs, unless told otherwise
        engines = self.routing.for_engines(DEFAULT_PROFILE, ReplicaConfig.max_num_batched_tokens)
        object.__setattr__(self, "routing", engines)

    def named_tokenizers(self) -> dict[str, str]:
        """``model_tokenizer``'s entries, by model."""
        named = {}
        for entry in self.model_tokenizer:
            model, sign, tokenizer = entry.partition("=")
            if not (model and sign and tokenizer):
                raise ValueError(f"--model-tokenizer {entry!r}: give MODEL=TOKENIZER")
            named[model] = tokenizer
        return named

    def configured_by(self, card: EngineCard, keep: Collection[str] = ()) -> GatewayConfig:
        """This configuration with what an engine says of itself (the model it serves,
        its tokenizer, block size and pool), except the fields named in ``keep`` (those
        the user set: ``model``, ``tokenizer``, ``block_size``, ``capacity_blocks``)."""
        changes: dict[str, object] = {}
        if "model" not in keep and card.model:
            changes["model"] = card.model
        if "tokenizer" not in keep and card.tokenizer:
            changes["tokenizer"] = card.tokenizer
        if "capacity_blocks" not in keep and card.num_blocks:
            changes["capacity_blocks"] = card.num_blocks
        routing = self.routing
        if "block_size" not in keep and card.block_size:
            routing = replace(routing, block_size=card.block_size)
        return replace(self, routing=routing, **changes)  # type: ignore[arg-type]


def _at_least(low: float, **values: float) -> None:
    """Refuse, at start, a value that would make every request fail: the flag named."""
    for name, value in values.items():
        if value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")


def _positive(**values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
