"""KV events: the changes to a replica's set of cached blocks, and their one codec.

A replica's prefix cache logs every block it stores and removes, and every time it
is cleared, as vLLM's KV events publish them (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``). A router that applies them in order knows exactly which
identities each replica holds. Over HTTP a replica serves them in pages
(``GET /kv_events?since=SEQ``), encoded and decoded only by the functions below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BeforeValidator, PlainSerializer, TypeAdapter

from replica.api.tokenizer import TOKEN_DTYPE


def _token_ids(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype=TOKEN_DTYPE).tolist()


def _token_bytes(value: Any) -> Any:
    return np.asarray(value, dtype=TOKEN_DTYPE).tobytes() if isinstance(value, list) else value


#: Token ids as little-endian uint32 bytes in memory, as a list of ints on the wire.
TokenBytes = Annotated[
    bytes, BeforeValidator(_token_bytes), PlainSerializer(_token_ids, return_type=list[int])
]

EventKind = Literal["stored", "removed", "cleared"]
#: Where a block lives, as vLLM's ``BlockStored.medium`` says: GPU memory or the host's.
Medium = Literal["GPU", "CPU"]


@dataclass(frozen=True, slots=True)
class KVEvent:
    """A change to the set of cached identities, numbered from 1 in the order it happened.

    ``stored`` blocks hang off ``parent_hash`` (``None`` for a prompt's first block)
    in the order given; ``removed`` blocks are gone; ``cleared`` forgets everything.
    ``block_depths`` (ours; empty from engines that do not send it) gives each
    block's position in its prompt, so a router that indexes only every k-th block
    boundary can ignore the others. ``medium`` says which tier the change happened
    in: a block evicted from the GPU and kept in host memory is ``removed`` on the
    GPU and ``stored`` on the CPU; ``cleared`` empties both.

    A ``stored`` event carries its blocks' tokens (``token_bytes``, in order, as
    vLLM's ``BlockStored.token_ids``) and, for a chain that starts a prompt, the cache
    salt and the LoRA adapter that seeded it: enough for a router to key the blocks
    with its own hash.
    """

    seq: int
    kind: EventKind
    block_hashes: tuple[int, ...] = ()
    parent_hash: int | None = None
    block_depths: tuple[int, ...] = ()
    medium: Medium = "GPU"
    token_bytes: TokenBytes = b""
    salt: str | None = None
    #: The LoRA adapter the chain was computed under (vLLM's ``BlockStored.lora_name``),
    #: which seeds its identities in place of the model's name; ``None``: the base model.
    lora: str | None = None


@dataclass(frozen=True)
class KVEventPage:
    """One answer of ``GET /kv_events?since=SEQ``: the events numbered above ``SEQ``.

    ``last_seq`` is where the next page starts; ``lost`` says that events after
    ``SEQ`` were dropped from the replica's bounded log, so the reader must forget
    what it knew of the replica and start again from these.
    """

    events: tuple[KVEvent, ...]
    last_seq: int
    lost: bool = False
    block_size: int | None = None


_PAGE = TypeAdapter(KVEventPage)


def encode_page(page: KVEventPage) -> bytes:
    """The page as JSON (the shape ``decode_page`` reads back)."""
    return _PAGE.dump_json(page)


def decode_page(data: bytes | str) -> KVEventPage:
    """A page from JSON; raises ``ValueError`` naming the field if it is not one."""
    return _PAGE.validate_json(data)
