"""An answer's stream gathered into fewer, larger items for its trip through Ray Serve.

Each item an engine replica yields crosses two Ray hops (to the ingress, then to the
proxy), and each hop costs per item, not per byte: at ``make demo``'s load, a chunk per
token kept this machine's CPUs two thirds busy and every Serve row's TTFT was the
starved CPU's. Ray Serve LLM gathers its streams the same way, every 50 ms
(``stream_batching_interval_ms``), its first token included; here what comes before
the first token and the first token itself go at once, so TTFT waits for nothing, and
only the tokens after it are gathered. The gathering ends early when the answer ends,
so its last token does not wait out the interval either.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp

#: Ray Serve LLM's default interval (``RAYLLM_MODEL_RESPONSE_BATCH_TIMEOUT_MS``).
DEFAULT_INTERVAL_MS = 50.0

#: What a chat stream's role announcement says, the one chunk an OpenAI-compatible
#: server sends before the first token (ours and vLLM's alike).
_ROLE = b'"role"'


async def gathered(content: aiohttp.StreamReader, interval_s: float) -> AsyncIterator[bytes]:
    """The answer's bytes as they come until its first token has gone, then what
    arrived in each ``interval_s`` as one item (0: every chunk as it comes)."""
    ended = asyncio.ensure_future(content.wait_eof())
    try:
        chunk = await content.readany()
        while chunk and _before_first_token(chunk):  # the role announcement
            yield chunk
            chunk = await content.readany()
        while chunk:
            yield chunk
            if interval_s > 0:
                await asyncio.wait({ended}, timeout=interval_s)
            chunk = content.read_nowait() or await content.readany()
    finally:  # the answer ended, or its reader left: nothing more to wait for
        ended.cancel()


def _before_first_token(chunk: bytes) -> bool:
    return _ROLE in chunk and b'"content":""' in chunk.replace(b" ", b"")
