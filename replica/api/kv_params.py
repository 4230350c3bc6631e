"""vLLM's ``kv_transfer_params`` protocol as our replicas and gateway write it.

vLLM's P/D proxies (its toy proxy, ``vllm-router --vllm-pd-disaggregation``) send a
request twice. First to a prefill replica, ``max_tokens`` 1 and

    "kv_transfer_params": {"do_remote_decode": true, ...}

which answers after its first token and returns, beside the choices, the parameters a
decode replica needs to pull the prompt's KV (its NIXL connector's shape):

    "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
        "remote_engine_id": ..., "remote_block_ids": [...], "remote_host": ...,
        "remote_port": ..., "remote_request_id": ..., "tp_size": 1}

Then, with those, to a decode replica, which pulls and decodes. Our replicas move no
bytes: the receiver asks the peer to lend the blocks (``POST /kv/lend``, sent by
replica/peers.py: pinned there while the pull runs), and its engine times the pull
over the peer link (replica/kv_transfer.py). A gateway that knows a peer holds a
prompt's prefix sends ``do_remote_prefill`` with the peer and ``pull_tokens`` alone: a
peer pull. A peer that cannot lend (gone, evicted, unreachable) lends nothing, and the
replica computes the prompt itself: a fallback, counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from replica.api.openai import Rejected

PARAM = "kv_transfer_params"


@dataclass(frozen=True)
class RemoteDecode:
    """Prefill for a decode replica: hold the prompt's blocks for its pull."""


@dataclass(frozen=True)
class RemotePrefill:
    """Pull the prompt's leading KV from the replica at ``url``: the blocks it holds
    for ``lease_id`` (a prefill's request id), else its leading ``pull_tokens``."""

    url: str
    lease_id: str | None = None
    pull_tokens: int | None = None


def parse(params: dict[str, Any] | None) -> RemoteDecode | RemotePrefill | None:
    """What a request's ``kv_transfer_params`` ask for (``None``: nothing); raises
    :class:`Rejected` (400) if they ask for something it cannot do."""
    if not params:
        return None
    if params.get("do_remote_decode"):
        return RemoteDecode()
    if not params.get("do_remote_prefill"):
        return None
    host, port = params.get("remote_host"), params.get("remote_port")
    if not host or not port:
        raise Rejected("do_remote_prefill needs remote_host and remote_port", 400, PARAM)
    tokens = params.get("pull_tokens")
    if tokens is not None and (not isinstance(tokens, int) or tokens < 0):
        raise Rejected("pull_tokens must be a whole number", 400, PARAM)
    lease = params.get("remote_request_id")
    return RemotePrefill(f"http://{host}:{port}", str(lease) if lease else None, tokens)


def prefill_params(base_url: str, request_id: str, blocks: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill answers with: where its decode replica
    pulls the ``blocks`` it holds for ``request_id``."""
    where = urlsplit(base_url)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": f"{where.hostname}:{where.port}",
        "remote_block_ids": list(range(blocks)),
        "remote_host": where.hostname,
        "remote_port": where.port,
        "remote_request_id": request_id,
        "tp_size": 1,
    }


def pull_params(peer_url: str, tokens: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` with which a gateway has a replica pull a peer's
    leading ``tokens`` (a peer pull)."""
    where = urlsplit(peer_url)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_host": where.hostname,
        "remote_port": where.port,
        "pull_tokens": tokens,
    }
