"""The reference a replay is read against: the hits of an unlimited cache that the
whole fleet shares (the reusable fraction of the workload)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from loadtest.replay.result import ReplayResult
from loadtest.workloads import Workload
from replica.api.identity import block_hashes, identity_seed


@dataclass(frozen=True)
class Bound:
    """Hits an unlimited cache shared by the whole fleet would score: the reusable
    fraction of the workload, for requests in the order they arrived."""

    prompt_tokens: int
    cached_tokens: int
    query_blocks: int
    hit_blocks: int


def infinite_cache_bound(workload: Workload, result: ReplayResult) -> Bound:
    """The bound over ``result``'s requests, in the order they arrived."""
    block_size = result.config.block_size
    seeds = lru_cache(maxsize=None)(identity_seed)  # by (name, salt): a replay's are few
    seen: set[int] = set()
    prompt_tokens = cached_tokens = query_blocks = hit_blocks = 0
    for record in sorted(result.records, key=lambda r: r.arrival_s):
        session = workload.sessions[record.session]
        turn = session.turns[record.turn]
        prompt = turn.prompt_token_ids
        turn.forget_prompt()
        name = session.served_name or result.config.model
        hashes = block_hashes(prompt, block_size, seeds(name, session.cache_salt))
        limit = (len(prompt) - 1) // block_size  # an engine computes the last token
        hits = next((i for i, h in enumerate(hashes[:limit]) if h not in seen), limit)
        seen.update(hashes)
        prompt_tokens += len(prompt)
        cached_tokens += hits * block_size
        query_blocks += len(hashes)
        hit_blocks += hits
    return Bound(prompt_tokens, cached_tokens, query_blocks, hit_blocks)
