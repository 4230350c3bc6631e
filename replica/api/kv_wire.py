"""KV events on the wire as vLLM publishes them (``--kv-events-config``), and back.

vLLM's ``ZmqEventPublisher`` sends multipart messages: the topic, an 8-byte big-endian
sequence number, and a msgpack ``KVEventBatch`` of ``BlockStored``, ``BlockRemoved``
and ``AllBlocksCleared`` events (``vllm/distributed/kv_events.py``). Over its releases
the encoding changed: the batch and its events were positional arrays (events tagged
by their class name first), then events became maps tagged by a ``type`` field, the
batch first staying an array, later a map too. :func:`decode_batch` reads all of them;
:func:`encode_batch` writes the newest, with the fields in vLLM's order.

Our replicas add what vLLM carries elsewhere: a chain root's cache salt goes in the
first block's ``extra_keys`` (where vLLM puts ``cache_salt``). A LoRA adapter's name
goes where vLLM puts it: ``lora_name``, and first in every block's ``extra_keys``.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from replica.api.kv_events import KVEvent, Medium
from replica.api.tokenizer import TOKEN_DTYPE

#: The fields of vLLM's events, in their declaration order (positional encodings).
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
BATCH_FIELDS = ("ts", "events", "data_parallel_rank")


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()


def encode_batch(
    events: list[KVEvent], ts: float, block_size: int, rank: int | None = None
) -> bytes:
    """A ``KVEventBatch`` of our events, as the newest vLLM encodes one (``rank``: the
    data-parallel engine's, where the server runs several)."""
    batch = EventBatch(ts, [_vllm_event(e, block_size) for e in events], rank)
    return _ENCODER.encode(batch)


def _vllm_event(event: KVEvent, block_size: int) -> KVCacheEvent:
    if event.kind == "stored":
        tokens = np.frombuffer(event.token_bytes, dtype=TOKEN_DTYPE).tolist()
        hashes = list(event.block_hashes)
        return BlockStored(
            hashes,
            event.parent_hash,
            tokens,
            block_size,
            None,
            event.medium,
            event.lora,
            _extra_keys(event),
        )
    if event.kind == "removed":
        return BlockRemoved(list(event.block_hashes), event.medium)
    return AllBlocksCleared()


def _extra_keys(event: KVEvent) -> list[list[Any] | None] | None:
    """vLLM's per-block extra keys: the LoRA adapter's name on every block, then the
    cache salt on a prompt's first block."""
    lora = [event.lora] if event.lora is not None else []
    salted = event.salt is not None and event.parent_hash is None
    if not lora and not salted:
        return None
    first = [*lora, event.salt] if salted else lora
    return [first, *([lora or None] * (len(event.block_hashes) - 1))]


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent], int | None]:
    """A ``KVEventBatch`` in any encoding vLLM used: its time, its events (numbered from
    0 within the batch) and the block size they say; raises ``ValueError`` if it is not
    one."""
    try:
        raw = _DECODER.decode(payload)
    except msgspec.DecodeError as error:
        raise ValueError(f"not msgpack: {error}") from None
    batch = _fields(raw, BATCH_FIELDS)
    if "events" not in batch or not isinstance(batch["events"], list):
        raise ValueError("not a KV event batch: no list of events")
    events, block_size = [], None
    for seq, item in enumerate(batch["events"]):
        event, size = _our_event(seq, item)
        events.append(event)
        block_size = size or block_size
    return float(batch.get("ts") or 0.0), events, block_size


def _our_event(seq: int, item: Any) -> tuple[KVEvent, int | None]:
    tag: Any
    if isinstance(item, list) and item and isinstance(item[0], str):
        tag, item = item[0], item[1:]
    elif isinstance(item, dict):
        tag = item.get("type")
    else:
        raise ValueError(f"not a KV event: {item!r:.80}")
    if tag == "BlockStored":
        f = _fields(item, STORED_FIELDS)
        tokens = np.asarray(f.get("token_ids") or [], dtype=TOKEN_DTYPE).tobytes()
        lora = f.get("lora_name") if isinstance(f.get("lora_name"), str) else None
        hashes = tuple(_hash(h) for h in f["block_hashes"])
        parent = None if f.get("parent_block_hash") is None else _hash(f["parent_block_hash"])
        salt = _salt(f.get("extra_keys"), lora is not None) if parent is None else None
        event = KVEvent(seq, "stored", hashes, parent, (), _medium(f), tokens, salt, lora)
        return event, f.get("block_size")
    if tag == "BlockRemoved":
        f = _fields(item, REMOVED_FIELDS)
        hashes = tuple(_hash(h) for h in f["block_hashes"])
        return KVEvent(seq, "removed", hashes, medium=_medium(f)), None
    if tag == "AllBlocksCleared":
        return KVEvent(seq, "cleared"), None
    raise ValueError(f"unknown KV event type {tag!r}")


def _salt(extra_keys: Any, after_lora: bool) -> str | None:
    """The cache salt in a first block's extra keys (after the adapter's name, if any)."""
    first = extra_keys[0] if isinstance(extra_keys, list) and extra_keys else None
    keys = list(first or ())[1 if after_lora else 0 :]
    return keys[-1] if keys and isinstance(keys[-1], str) else None


def _fields(item: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """A positional array or a map, as a map (missing trailing fields left out)."""
    if isinstance(item, dict):
        return item
    if isinstance(item, list):
        return dict(zip(names, item, strict=False))
    raise ValueError(f"expected an array or a map, got {type(item).__name__}")


def _hash(value: Any) -> int:
    """An engine's block hash: an int, or bytes (vLLM's sha256 hashes) read as one."""
    if isinstance(value, int):
        return value
    if isinstance(value, bytes):
        return int.from_bytes(value, "big")
    raise ValueError(f"a block hash is an int or bytes, got {type(value).__name__}")


def _medium(fields: dict[str, Any]) -> Medium:
    return "CPU" if str(fields.get("medium") or "GPU").upper() == "CPU" else "GPU"
