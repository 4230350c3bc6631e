"""One request inside the engine: its tokens, its block table and its progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from replica.api.identity import BlockHasher
from replica.api.tokenizer import TOKEN_DTYPE
from replica.prefix_cache import Block


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # the model produced EOS
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the caller


@dataclass(frozen=True)
class EngineRequest:
    """What a caller submits. ``cache_salt`` scopes block identities (per tenant)."""

    request_id: str
    prompt_token_ids: np.ndarray
    max_tokens: int
    ignore_eos: bool = False
    cache_salt: str | None = None
    #: Seeds the toy model's sampling (a request's ``seed``); ``None``: from its id.
    sample_seed: int | None = None
    #: No EOS before this many tokens (vLLM's ``min_tokens``).
    min_tokens: int = 0
    #: ``(token id, bias)`` pairs added to the toy model's (equal) logits, as vLLM adds
    #: a request's ``logit_bias`` to its model's.
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: The LoRA adapter it runs under (its name seeds the request's block identities);
    #: ``None``: the base model.
    lora: str | None = None
    #: Seconds its prompt's blocks stay pinned after it finishes, for a decode replica
    #: to pull (vLLM's ``do_remote_decode``; 0: freed at once).
    hold_s: float = 0.0
    #: Leading prompt tokens a peer lends it, pulled before it is prefilled (vLLM's
    #: ``do_remote_prefill``; 0: none). See replica/kv_transfer.py.
    pull_tokens: int = 0
    #: Whether its prompt was prefilled on another replica, whose cache counted it (a
    #: P/D decode): not a query of this cache.
    prefilled_elsewhere: bool = False

    def __post_init__(self) -> None:
        if len(self.prompt_token_ids) == 0:
            raise ValueError("the prompt must hold at least one token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.hold_s < 0 or self.pull_tokens < 0:
            raise ValueError("hold_s and pull_tokens must not be negative")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must lie in [0, max_tokens], got {self.min_tokens}")


@dataclass(eq=False, slots=True)
class Sequence:
    """Engine-side state of one request. Its tokens are the prompt then the output.

    ``block_hashes`` holds the identity of every full block of those tokens;
    ``num_cached_blocks`` leading entries of ``block_table`` are registered in the
    prefix cache. Preemption frees the blocks and resets ``num_computed_tokens``;
    the tokens and identities stay, so the request recomputes and may hit again.
    """

    request: EngineRequest
    hasher: BlockHasher
    sample_seed: int
    request_id: str = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_tokens: int = field(init=False)
    token_bytes: bytearray = field(init=False)
    block_hashes: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[Block] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_blocks: int = 0
    num_cached_prompt_tokens: int | None = None
    num_preemptions: int = 0
    #: Leading prompt blocks pulled from a peer, to be taken as computed when it is
    #: first admitted (a preempted request recomputes them).
    pulled_blocks: int = 0
    cacheable: bool = True
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        prompt = np.ascontiguousarray(self.request.prompt_token_ids, dtype=TOKEN_DTYPE)
        self.request_id = self.request.request_id
        self.num_prompt_tokens = self.num_tokens = len(prompt)
        self.token_bytes = bytearray(prompt.tobytes())
        self.block_hashes = self.hasher.extend_bytes(bytes(self.token_bytes))

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def append_tokens(self, token_ids: list[int]) -> None:
        """Append several tokens at once (a decode burst)."""
        raw = np.array(token_ids, dtype=TOKEN_DTYPE).tobytes()
        self.output_token_ids += token_ids
        self.token_bytes += raw
        self.num_tokens += len(token_ids)
        self.block_hashes += self.hasher.extend_bytes(raw)

    def append_token(self, token_id: int) -> None:
        raw = token_id.to_bytes(TOKEN_DTYPE.itemsize, "little")
        self.output_token_ids.append(token_id)
        self.token_bytes += raw
        self.num_tokens += 1
        if self.num_tokens % self.hasher.block_size == 0:  # only then is a block complete
            self.block_hashes += self.hasher.extend_bytes(raw)
        else:
            self.hasher.hold(raw)
