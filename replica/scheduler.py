"""Continuous batching over a prefix cache: which tokens of which requests run next.

Each step has a token budget. Running requests go first, in arrival order: a decode
takes one token, an unfinished prefill takes the rest of its prompt up to the budget
(chunked prefill). If their blocks run out, the latest-arrived running request is
preempted (its blocks freed, to be recomputed later, where it may hit the cache).
Then waiting requests are admitted first come, first served, each starting after its
longest cached prefix, while the budget, the blocks and the cap on running requests
allow. A prefix cached on the GPU is pinned; where it ends, a run of blocks held by
the host tier is loaded back (copied into new GPU blocks, registered at once) when the
cost model says loading beats recomputing it. A request under a LoRA adapter that
finds no GPU slot for it is passed over, as vLLM's scheduler does, and keeps its place
at the head of the queue (see ``replica/lora.py``).

A block is registered in the cache when the step that fills it is scheduled, as vLLM
V1 does, not once that step has run: a request admitted later in the same step then
finds it, so requests that arrive together with the same new prefix (the ``n``
choices of one prompt, a burst of users on a new system prompt) compute it once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from replica.host_cache import HostCache
from replica.lora import AdapterSlots
from replica.prefix_cache import Block, PrefixCache
from replica.sequence import FinishReason, Sequence, Status

#: (host tokens, cached tokens before them, tokens to compute after them) -> load them?
LoadPolicy = Callable[[int, int, int], bool]


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step (vLLM's ``max_num_batched_tokens`` and ``max_num_seqs``)."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` computed this step, after ``num_computed`` ones."""

    seq: Sequence
    num_computed: int
    num_tokens: int
    #: Of ``num_computed``, the tokens loaded from the host tier for this step.
    loaded_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: PrefixCache,
        host: HostCache | None = None,
        should_load: LoadPolicy = lambda host_tokens, computed, remaining: True,
        adapters: AdapterSlots | None = None,
    ) -> None:
        self.config = config
        self.adapters = adapters or AdapterSlots(1)
        self.cache = cache
        self.host = host
        self.should_load = should_load
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        #: The head of the queue that did not fit, and the state it did not fit in.
        self._stalled: tuple[Sequence, int, tuple[int, int]] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """Choose this step's work and pin the blocks it needs."""
        budget = self.config.max_num_batched_tokens
        chunks, preempted = self._schedule_running(budget)
        budget -= sum(c.num_tokens for c in chunks)
        if not preempted or not self.running:  # after a preemption, admit only into an empty batch
            chunks += self._admit_waiting(budget)
        return chunks

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledChunk], bool]:
        chunks: list[ScheduledChunk] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            while not self._grow(seq, seq.num_computed_tokens + num_tokens):
                preempted = True
                victim = self.running.pop()
                self._preempt(victim)
                if victim is seq:
                    return chunks, preempted
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_tokens))
            self._register(seq, seq.num_computed_tokens + num_tokens)
            budget -= num_tokens
            index += 1
        return chunks, preempted

    def _admit_waiting(self, budget: int) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        passed_over: list[Sequence] = []  # their adapters have no GPU slot this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.adapters.can_run(seq.request.lora):
                passed_over.append(self.waiting.popleft())
                continue
            state = (
                self.cache.last_event_seq,
                self.cache.num_free_blocks + self.cache.num_idle_blocks,
            )
            if self._stalled == (seq, budget, state):
                break  # nothing it needs has changed since it did not fit: it still does not
            token_bytes = bytes(seq.token_bytes)
            hits = self._match(seq, token_bytes)
            loaded = self._host_run(seq, token_bytes, len(hits))
            pulled = self._pulled_run(seq, len(hits) + loaded)
            num_computed = (len(hits) + loaded + pulled) * self.cache.block_size
            num_tokens = min(seq.num_tokens - num_computed, budget)
            num_new_blocks = self._blocks_for(num_computed + num_tokens) - len(hits)
            idle_hits = sum(block.ref_count == 0 for block in hits)  # hits stop being reclaimable
            if not self.cache.can_allocate(num_new_blocks + idle_hits):
                self._stalled = (seq, budget, state)
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.adapters.use(seq.request.lora)
            stop = len(hits) + loaded + pulled
            if loaded:  # copied first: the allocation below may demote into a full host
                assert self.host is not None
                self.host.loaded(seq.block_hashes[len(hits) : len(hits) + loaded])
            self.cache.acquire(hits)
            seq.block_table = hits + self.cache.allocate(num_new_blocks)
            if loaded or pulled:  # the copies hold the KV now: cache them, as computed blocks
                self.cache.cache_blocks(
                    seq.block_table,
                    len(hits),
                    stop,
                    seq.block_hashes,
                    seq.token_bytes,
                    seq.request.cache_salt,
                    seq.request.lora,
                )
            seq.num_cached_blocks = stop
            seq.num_computed_tokens = num_computed
            seq.pulled_blocks = 0  # taken: a preempted request recomputes them
            loaded_tokens = loaded * self.cache.block_size
            self._record_query(seq, num_computed, loaded_tokens, pulled * self.cache.block_size)
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, num_computed, num_tokens, loaded_tokens))
            self._register(seq, num_computed + num_tokens)
            budget -= num_tokens
        self.waiting.extendleft(reversed(passed_over))
        return chunks

    def _max_blocks(self, seq: Sequence) -> int:
        """Blocks a prompt may take from the caches: at least one token is computed
        (it yields the logits of the first new token)."""
        return (seq.num_tokens - 1) // self.cache.block_size

    def _match(self, seq: Sequence, token_bytes: bytes) -> list[Block]:
        """Leading blocks cached on the GPU."""
        return self.cache.match(seq.block_hashes[: self._max_blocks(seq)], token_bytes)

    def _host_run(self, seq: Sequence, token_bytes: bytes, start: int) -> int:
        """How many blocks from ``start`` to load from the host tier (0: recompute them)."""
        if self.host is None:
            return 0
        hashes = seq.block_hashes[: self._max_blocks(seq)]
        run = self.host.match(hashes, token_bytes, start)
        for index in range(start, start + run):  # the GPU holds it with other tokens
            if self.cache.lookup(hashes[index]) is not None:
                run = index - start
                break
        size = self.cache.block_size
        computed = start * size
        if run and self.should_load(run * size, computed, seq.num_tokens - computed - run * size):
            return run
        return 0

    def _pulled_run(self, seq: Sequence, start: int) -> int:
        """How many blocks from ``start`` a finished pull brought (0: none left)."""
        return max(0, min(seq.pulled_blocks, self._max_blocks(seq)) - start)

    def _record_query(
        self, seq: Sequence, num_cached: int, num_loaded: int, num_pulled: int = 0
    ) -> None:
        """Count a request's prompt once, not again when it resumes from preemption:
        its cached tokens from both tiers and from a peer (pulled: hits of the fleet's
        caches, as vLLM reports an external hit), those loaded from the host and those
        pulled among them. A prompt prefilled on another replica was counted there."""
        if seq.num_cached_prompt_tokens is not None:
            return
        seq.num_cached_prompt_tokens = num_cached
        if seq.request.prefilled_elsewhere:
            return
        stats = self.cache.stats
        size = self.cache.block_size
        stats.query_tokens += seq.num_prompt_tokens
        stats.hit_tokens += num_cached
        stats.pulled_tokens += num_pulled
        stats.query_blocks += seq.num_prompt_tokens // size
        stats.hit_blocks += num_cached // size
        stats.host_hit_tokens += num_loaded
        stats.host_hit_blocks += num_loaded // size

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.cache.block_size)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` blocks for ``num_tokens`` tokens; ``False`` if the pool is short."""
        missing = self._blocks_for(num_tokens) - len(seq.block_table)
        if missing <= 0:
            return True
        if not self.cache.can_allocate(missing):
            return False
        seq.block_table += self.cache.allocate(missing)
        return True

    def can_grow_all(self, num_steps: int) -> bool:
        """Whether :meth:`grow_all` would succeed."""
        return self.cache.can_allocate(sum(m for m in self._missing(num_steps) if m > 0))

    def grow_all(self, num_steps: int) -> bool:
        """Give every running request blocks for ``num_steps`` more decode tokens, or none."""
        missing = self._missing(num_steps)
        if not self.cache.can_allocate(sum(m for m in missing if m > 0)):
            return False
        for seq, count in zip(self.running, missing, strict=True):
            if count > 0:
                seq.block_table += self.cache.allocate(count)
        return True

    def _missing(self, num_steps: int) -> list[int]:
        """Blocks each running request lacks for ``num_steps`` more decode tokens."""
        return [
            self._blocks_for(seq.num_computed_tokens + num_steps) - len(seq.block_table)
            for seq in self.running
        ]

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        self.adapters.done(seq.request.lora)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _free(self, seq: Sequence) -> None:
        self.cache.release(reversed(seq.block_table))
        seq.block_table = []
        seq.num_cached_blocks = 0

    def commit(self, chunk: ScheduledChunk) -> None:
        """Record that ``chunk`` was computed (its blocks were registered when it was
        scheduled)."""
        chunk.seq.num_computed_tokens = chunk.num_computed + chunk.num_tokens

    def commit_burst(self, seq: Sequence, num_computed: int, num_tokens: int) -> None:
        """Record ``num_tokens`` decode iterations of ``seq`` run as one burst, and
        register the blocks they filled (their tokens were drawn as the burst ran)."""
        self.commit(ScheduledChunk(seq, num_computed, num_tokens))
        self._register(seq, seq.num_computed_tokens)

    def _register(self, seq: Sequence, num_tokens: int) -> None:
        """Cache the full blocks of ``seq``'s first ``num_tokens`` tokens not cached yet."""
        num_full = min(num_tokens // self.cache.block_size, len(seq.block_hashes))
        if not seq.cacheable or seq.num_cached_blocks >= num_full:
            return
        done = self.cache.cache_blocks(
            seq.block_table,
            seq.num_cached_blocks,
            num_full,
            seq.block_hashes,
            seq.token_bytes,
            seq.request.cache_salt,
            seq.request.lora,
        )
        seq.num_cached_blocks += done
        if seq.num_cached_blocks < num_full:
            seq.cacheable = False  # a hash collision: that block stays private, and those after

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Free a request's blocks and drop it from whichever queue holds it."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.adapters.done(seq.request.lora)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
