"""The simulated engine: a prefix cache, a scheduler, a timing model and a toy model.

``Engine.step()`` runs one continuous-batching iteration and returns the tokens it
produced with the simulated duration of that step. It does no I/O, never sleeps and
never reads the wall clock: its ``now`` is virtual time, advanced by step durations
(and by :meth:`Engine.advance_to` when the caller lets it idle). Given the same seed
and the same calls, it produces the same tokens and the same durations.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import xxhash

from replica.api.config import DEFAULT_PROFILE, ReplicaConfig
from replica.api.cost_model import (
    BatchShape,
    CostProfile,
    HostLink,
    attention_pairs,
    get_link,
    get_peer_link,
    get_profile,
)
from replica.api.identity import DEFAULT_BLOCK_SIZE, DEFAULT_MODEL, BlockHasher, identity_seed
from replica.api.tokenizer import ByteTokenizer, Tokenizer
from replica.host_cache import HostCache
from replica.kv_transfer import Leases, Pulls, TransferStats
from replica.lora import AdapterSlots
from replica.prefix_cache import CacheStats, PrefixCache
from replica.sampling import biased_token, unbiased_share
from replica.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from replica.sequence import EngineRequest, FinishReason, Sequence, Status

#: The engine's face to its drivers (the replica server and the offline replayer).
__all__ = [
    "Burst",
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "RequestOutput",
    "SchedulerConfig",
    "StepResult",
]

HasherFactory = Callable[[int, int], BlockHasher]  # (block_size, seed) -> hasher


@dataclass(frozen=True)
class EngineConfig:
    """An engine replica's shape. ``num_blocks`` x ``block_size`` tokens of KV cache."""

    model: str = DEFAULT_MODEL
    num_blocks: int = 8192
    block_size: int = DEFAULT_BLOCK_SIZE
    profile: str = DEFAULT_PROFILE
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    #: Chance that the toy model ends a reply at each token, unless the request
    #: ignores EOS; 1/256 gives replies of 256 tokens on average.
    eos_probability: float = 1 / 256
    #: How many times faster than the profile's hardware this engine runs: its steps,
    #: host loads and pulls (reference rows use it to stand for a whole fleet's compute
    #: in one engine; a live replica's ``speedup`` slows all of it alike).
    compute_scale: float = 1.0
    seed: int = 0
    #: Blocks of the host-memory tier (0: none) and its link ("": the profile's).
    host_blocks: int = 0
    host_link: str = ""
    #: LoRA adapters it serves from the start (more can be loaded at run time), and how
    #: many one batch may use at once (vLLM's ``--lora-modules`` and ``--max-loras``).
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 1
    #: The link KV is pulled from peers over (replica/kv_transfer.py): nvlink,
    #: rdma200, rdma400, tcp or GB/s.
    peer_link: str = "rdma200"

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.model in self.lora_modules:
            raise ValueError(f"a LoRA adapter may not be named as the model, {self.model!r}")
        if self.host_blocks < 0:
            raise ValueError(f"host_blocks must not be negative, got {self.host_blocks}")
        if self.host_link:
            get_link(self.host_link)
        get_peer_link(self.peer_link)
        if not 0.0 <= self.eos_probability <= 1.0:
            raise ValueError("eos_probability must lie in [0, 1]")
        if self.compute_scale <= 0:
            raise ValueError("compute_scale must be positive")
        get_profile(self.profile)

    @classmethod
    def for_replica(cls, replica: ReplicaConfig) -> EngineConfig:
        """The engine of a replica, its capacities derived from its profile where the
        replica leaves them out; raises ``ValueError`` naming what is wrong with it."""
        scheduler = SchedulerConfig(replica.max_num_batched_tokens, replica.max_num_seqs)
        profile = get_profile(replica.profile)
        return cls(
            replica.model,
            replica.num_blocks or profile.kv_blocks(replica.block_size),
            replica.block_size,
            replica.profile,
            scheduler,
            seed=replica.seed,
            host_blocks=(
                profile.host_blocks(replica.block_size)
                if replica.host_blocks is None
                else replica.host_blocks
            ),
            host_link=replica.host_link,
            lora_modules=replica.adapters,
            max_loras=replica.max_loras,
            peer_link=replica.peer_link,
        )

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


class EngineDead(RuntimeError):
    """The engine stopped stepping (an error killed its loop): every request waiting on
    it, and every later one, fails with this, as vLLM's do once its engine is dead."""


@dataclass(slots=True)
class RequestOutput:
    """What one request produced in one step (at most one token: no speculation)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


@dataclass(frozen=True)
class StepResult:
    """What one call to :meth:`Engine.step` did: ``num_steps`` iterations (1 unless a
    decode burst), their total duration, and per request the tokens produced."""

    duration_s: float
    outputs: list[RequestOutput]
    batch: BatchShape
    num_steps: int = 1


@dataclass(frozen=True)
class Burst:
    """Decode iterations planned from ``start_s``: how long the first k of them take."""

    start_s: float
    elapsed: list[float]  # elapsed[k - 1]: the first k iterations' duration
    batch: BatchShape
    #: Tokens drawn while planning, for the requests an EOS may end (the rest are
    #: drawn when the burst runs, and only for the iterations it runs).
    drawn: dict[str, list[int]] = field(default_factory=dict)

    @property
    def max_steps(self) -> int:
        return len(self.elapsed)

    def end_of(self, steps: int) -> float:
        return self.start_s + self.elapsed[steps - 1]

    def steps_past(self, time_s: float) -> int:
        """Iterations to run for the last of them to end after ``time_s``: a request
        that comes at ``time_s`` joins the batch after that one, as with single steps."""
        ends_by = bisect_right(self.elapsed, time_s, key=lambda elapsed: self.start_s + elapsed)
        return min(ends_by + 1, self.max_steps)


class Engine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        hasher_factory: HasherFactory = BlockHasher,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.cost: CostProfile = get_profile(self.config.profile)
        self.link: HostLink = (
            get_link(self.config.host_link) if self.config.host_link else self.cost.host_link
        )
        self.cache = PrefixCache(self.config.num_blocks, self.config.block_size)
        self.host: HostCache | None = None
        if self.config.host_blocks:
            self.host = HostCache(
                self.config.host_blocks, self.config.block_size, self.cache.events
            )
            self.cache.on_evicted = self.host.store
        self.adapters = AdapterSlots(self.config.max_loras, self.config.lora_modules)
        self.scheduler = Scheduler(
            self.config.scheduler, self.cache, self.host, self._should_load, self.adapters
        )
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self._vocabulary_ids = frozenset(self.tokenizer.vocabulary)  # for logit_bias
        self._hasher_factory = hasher_factory
        self._seqs: dict[str, Sequence] = {}
        self.peer_link: HostLink = get_peer_link(self.config.peer_link)
        self.transfers = TransferStats()
        self.leases = Leases(self.cache, self.transfers)
        self.pulls = Pulls(self._pull_s, self.transfers)
        self.now = 0.0
        self.busy_s = 0.0
        self.num_steps = 0
        self.prefill_tokens_computed = 0

    # ----------------------------------------------------------------- requests

    def add_request(self, request: EngineRequest, arrived_s: float | None = None) -> None:
        """Queue a request; raises ValueError if it could never fit in the KV cache.
        ``arrived_s``: when it came, if later than :attr:`now` (a driver that runs a
        decode burst's iterations at its end: a pull starts when the request came)."""
        if request.request_id in self._seqs:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        needed = len(request.prompt_token_ids) + request.max_tokens
        if needed > self.config.capacity_tokens:
            raise ValueError(
                f"prompt ({len(request.prompt_token_ids)} tokens) plus max_tokens "
                f"({request.max_tokens}) exceeds the KV cache "
                f"({self.config.capacity_tokens} tokens)"
            )
        self.adapters.check(request.lora)
        seed = identity_seed(request.lora or self.config.model, request.cache_salt)
        hasher = self._hasher_factory(self.config.block_size, seed)
        sample_seed = request.sample_seed
        if sample_seed is None:
            sample_seed = xxhash.xxh3_64_intdigest(
                request.request_id.encode(), seed=self.config.seed
            )
        seq = Sequence(request, hasher, sample_seed)
        self._seqs[request.request_id] = seq
        if not self._awaits_kv(seq, max(self.now, arrived_s or 0.0)):
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks; ``False`` if it is unknown or finished."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if self.pulls.drop(seq):  # never queued: nothing held
            seq.status, seq.finish_reason = Status.FINISHED, FinishReason.ABORT
            return True
        self.scheduler.finish(seq, FinishReason.ABORT)
        return True

    # ------------------------------------------------------------ KV transfers

    def _awaits_kv(self, seq: Sequence, now: float) -> bool:
        """Whether ``seq`` waits, out of the batch, for KV to cross the link: for a pull
        under way that brings more of its prompt than this cache holds and at least
        what a peer lends it (two requests of one prefix sent here together: the second
        would otherwise compute what is arriving), else for its own pull of the leading
        blocks a peer lends it that this cache lacks. ``False``: it queues at once."""
        if not (seq.request.pull_tokens or self.pulls):
            return False
        size = self.config.block_size
        usable = seq.block_hashes[: (seq.num_tokens - 1) // size]  # the last token computed
        lent = min(seq.request.pull_tokens // size, len(usable))
        arriving, ends = self.pulls.arriving(usable)
        if not (lent or arriving):  # nothing crosses the link for it: no cache look-up
            return False
        local = len(self.cache.match(usable[: max(lent, arriving)], bytes(seq.token_bytes)))
        if arriving > local and arriving >= lent:
            self.pulls.wait_for(seq, arriving, ends)
            return True
        if lent <= local:
            return False
        seq.pulled_blocks = lent
        self.pulls.start(seq, (lent - local) * size, now)
        return True

    def pull_would_end_s(self, tokens: int) -> float:
        """When a pull of ``tokens`` started now would end (after those under way)."""
        return self.pulls.would_end_s(tokens, self.now)

    def _pull_s(self, tokens: int) -> float:
        """A pull's seconds, as fast as the replica runs (as its host loads are)."""
        return self.cost.transfer_time(tokens, self.peer_link) / self.config.compute_scale

    def pull_end_s(self, request_id: str) -> float | None:
        """When the pull of a request added with ``pull_tokens`` ends (``None``: none
        under way)."""
        return self.pulls.end_of(request_id)

    @property
    def next_pull_s(self) -> float | None:
        """When the first pull under way ends: an idle engine's driver wakes it then."""
        return self.pulls.next_end_s

    def lend(self, lease_id: str, block_hashes: list[int], until_s: float) -> int:
        """Pin, until ``until_s``, the blocks a peer will pull: those held for
        ``lease_id`` (a finished prefill's), else the leading ones of ``block_hashes``
        this cache holds. Returns how many blocks (0: none)."""
        self.leases.expire(self.now)
        return self.leases.lend(lease_id, block_hashes, until_s)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self.pulls)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued, those whose pull is under way among them (as vLLM counts
        its requests waiting for remote KV)."""
        return len(self.scheduler.waiting) + len(self.pulls)

    @property
    def free_blocks(self) -> int:
        """GPU blocks a new request could be given: free, or cached and unused."""
        return self.cache.num_free_blocks + self.cache.num_idle_blocks

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens of the waiting and running requests not computed yet."""
        scheduler = self.scheduler
        size = self.config.block_size  # a pulled block is as good as a computed one
        queued = sum(
            max(seq.num_prompt_tokens - max(seq.num_computed_tokens, seq.pulled_blocks * size), 0)
            for queue in (scheduler.waiting, scheduler.running)
            for seq in queue
        )
        pulls = self.pulls
        return queued + sum(seq.num_prompt_tokens - pulls.brings(seq) * size for seq in pulls)

    # --------------------------------------------------------------------- time

    def advance_to(self, now: float) -> None:
        """Let virtual time pass while idle (the clock never goes backwards)."""
        self.now = max(self.now, now)

    def step(self) -> StepResult:
        """Run one iteration; an idle engine returns an empty result of zero duration
        (as does one whose only requests are pulling their KV: see :attr:`next_pull_s`)."""
        self.leases.expire(self.now)
        for seq in self.pulls.ended(self.now):  # their pulls done: they queue now
            self.scheduler.add(seq)
        chunks = self.scheduler.schedule()
        batch = batch_shape(chunks, self.adapters.take_loads())
        duration = self.cost.step_time(batch, self.link) / self.config.compute_scale
        self.now += duration
        self.busy_s += duration
        self.num_steps += bool(chunks)
        self.prefill_tokens_computed += batch.prefill_tokens
        outputs = [out for chunk in chunks if (out := self._advance(chunk)) is not None]
        return StepResult(duration, outputs, batch)

    def _advance(self, chunk: ScheduledChunk) -> RequestOutput | None:
        self.scheduler.commit(chunk)
        seq = chunk.seq
        if seq.num_uncomputed_tokens:
            return None  # a prefill chunk that did not reach the end of the prompt
        token = self._sample(seq)
        seq.append_token(token)
        return self._output(seq, [token])

    def _output(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        """Report new tokens; finish the request if the last one ends it."""
        reason = self._stop_reason(seq, tokens[-1])
        if reason is not None:
            if seq.request.hold_s:  # a remote decode will pull the prompt's blocks
                blocks = seq.block_table[: seq.num_cached_blocks]
                self.leases.hold(seq.request_id, blocks, self.now + seq.request.hold_s)
            self.scheduler.finish(seq, reason)
            del self._seqs[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            finished=reason is not None,
            finish_reason=reason.value if reason else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_prompt_tokens or 0,
            num_output_tokens=len(seq.output_token_ids),
        )

    # ------------------------------------------------------------ decode bursts

    def plan_burst(self, max_steps: int) -> Burst | None:
        """Up to ``max_steps`` decode iterations that could run from now, or ``None``
        unless the batch is decodes only (nothing waiting, no prefill) and at least two
        iterations fit (a request's end, an EOS, or the KV pool's room stop them).

        Nothing changes until :meth:`run_burst`, which may run fewer of them: a caller
        that learns of a new request mid-burst (the offline replayer) runs the burst to
        the first iteration ending after the request came, and the engine then does
        exactly what single steps would have done.
        """
        scheduler = self.scheduler
        running = scheduler.running
        if scheduler.waiting or not running or any(s.num_uncomputed_tokens != 1 for s in running):
            return None
        steps = min(max_steps, *(s.request.max_tokens - len(s.output_token_ids) for s in running))
        drawn = {}
        for seq in running:  # a reply that may end with EOS ends the burst there
            if not seq.request.ignore_eos and steps > 1:
                drawn[seq.request_id] = tokens = self._draw_tokens(seq, steps)
                steps = min(steps, len(tokens))
        if steps < 2 or not scheduler.can_grow_all(steps):
            return None
        context = sum(s.num_computed_tokens + 1 for s in running)
        scale = self.config.compute_scale
        durations = [d / scale for d in self.cost.decode_step_times(len(running), context, steps)]
        batch = BatchShape(decode_seqs=len(running), decode_context_tokens=context)
        burst = Burst(self.now, list(accumulate(durations)), batch, drawn)
        if (pull_ends := self.pulls.next_end_s) is not None:  # it joins after that iteration
            steps = burst.steps_past(pull_ends)
            burst = Burst(self.now, burst.elapsed[:steps], batch, drawn)
        return burst if burst.max_steps >= 2 else None

    def run_burst(self, burst: Burst, steps: int) -> StepResult:
        """Run the first ``steps`` iterations of a burst planned on this engine's
        current state (only new requests may have been added since)."""
        assert self.now == burst.start_s and 1 <= steps <= burst.max_steps
        if not self.scheduler.grow_all(steps):
            raise RuntimeError("a planned burst lost its KV blocks")
        duration = burst.elapsed[steps - 1]
        self.now += duration
        self.busy_s += duration
        self.num_steps += steps
        running = list(self.scheduler.running)
        outputs = [self._advance_by(seq, self._burst_tokens(burst, seq, steps)) for seq in running]
        return StepResult(duration, outputs, burst.batch, steps)

    def _burst_tokens(self, burst: Burst, seq: Sequence, steps: int) -> list[int]:
        drawn = burst.drawn.get(seq.request_id)
        return drawn[:steps] if drawn is not None else self._draw_tokens(seq, steps)

    def _draw_tokens(self, seq: Sequence, count: int) -> list[int]:
        """The next ``count`` tokens of ``seq``, cut after an EOS it does not ignore."""
        first = len(seq.output_token_ids)
        tokens = [self._sample_at(seq, first + i) for i in range(count)]
        eos = self.tokenizer.eos_token_id
        if not seq.request.ignore_eos and eos in tokens:
            del tokens[tokens.index(eos) + 1 :]
        return tokens

    def _advance_by(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        """Apply a burst: ``len(tokens)`` decode iterations of ``seq``."""
        computed = seq.num_computed_tokens
        seq.append_tokens(tokens)
        self.scheduler.commit_burst(seq, computed, len(tokens))
        return self._output(seq, tokens)

    def _sample(self, seq: Sequence) -> int:
        return self._sample_at(seq, len(seq.output_token_ids))

    def _sample_at(self, seq: Sequence, index: int) -> int:
        """A token that depends only on the seed, the request id and the position."""
        draw = xxhash.xxh3_64_intdigest(index.to_bytes(4, "little"), seed=seq.sample_seed)
        request = seq.request
        vocabulary = self.tokenizer.vocabulary
        eos_probability = self.config.eos_probability
        if request.logit_bias:  # a token the bias raises holds EOS back as it does the rest
            share = unbiased_share(len(vocabulary), self._vocabulary_ids, request.logit_bias)
            eos_probability *= share
        may_end = not request.ignore_eos and index >= request.min_tokens
        if may_end and (draw >> 40) < eos_probability * (1 << 24):
            return self.tokenizer.eos_token_id
        if request.logit_bias:
            return biased_token(draw, vocabulary, self._vocabulary_ids, request.logit_bias)
        return vocabulary[draw % len(vocabulary)]

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        if not seq.request.ignore_eos and token == self.tokenizer.eos_token_id:
            return FinishReason.STOP
        if len(seq.output_token_ids) >= seq.request.max_tokens:
            return FinishReason.LENGTH
        return None

    # ------------------------------------------------------------------ figures

    @property
    def cache_stats(self) -> CacheStats:
        return self.cache.stats

    @property
    def block_bytes(self) -> int:
        """Bytes of KV in one block (all GPUs of the replica together)."""
        return self.config.block_size * self.cost.kv_bytes_per_token

    @property
    def bytes_to_host(self) -> int:
        return self.host.stats.stored_blocks * self.block_bytes if self.host is not None else 0

    @property
    def bytes_to_gpu(self) -> int:
        return self.host.stats.loaded_blocks * self.block_bytes if self.host is not None else 0

    def _should_load(self, host_tokens: int, computed: int, remaining: int) -> bool:
        return self.cost.load_beats_recompute(host_tokens, computed, remaining, self.link)

    def reset_cache(self) -> bool:
        """Clear both tiers and their statistics; refused while requests run."""
        if self.has_unfinished:
            return False
        self.leases.release_all()
        if not self.cache.reset():
            return False
        if self.host is not None:
            self.host.reset()
        return True


def batch_shape(chunks: list[ScheduledChunk], adapter_loads: int = 0) -> BatchShape:
    """Summarise a step's chunks for the cost model: only computed tokens cost compute."""
    prefill_seqs = prefill_tokens = decode_seqs = decode_context = 0
    loaded_tokens = load_transfers = 0
    pairs = 0.0
    for chunk in chunks:
        if chunk.num_tokens == 1 and chunk.seq.output_token_ids:
            decode_seqs += 1
            decode_context += chunk.num_computed + 1
        else:
            prefill_seqs += 1
            prefill_tokens += chunk.num_tokens
            pairs += attention_pairs(chunk.num_computed, chunk.num_tokens)
        if chunk.loaded_tokens:
            loaded_tokens += chunk.loaded_tokens
            load_transfers += 1
    return BatchShape(
        prefill_seqs,
        prefill_tokens,
        pairs,
        decode_seqs,
        decode_context,
        loaded_tokens,
        load_transfers,
        adapter_loads,
    )
