"""A replica's calls to its peers for KV (``POST /kv/lend``): the receiving side of
the ``kv_transfer_params`` protocol (its wire format: replica/api/kv_params.py)."""

from __future__ import annotations

import logging

import aiohttp

from replica.api.fleet_token import bearer
from replica.api.kv_params import RemotePrefill

log = logging.getLogger(__name__)

#: How long a receiver waits for its peer to lend before computing the prompt itself.
LEND_TIMEOUT_S = 2.0


class Peers:
    """The replica's calls to its peers' ``POST /kv/lend``."""

    def __init__(self, fleet_token: str = "") -> None:
        self._session: aiohttp.ClientSession | None = None
        self._headers = bearer(fleet_token)  # a peer answers only its fleet

    async def lend(
        self, prefill: RemotePrefill, lease_id: str, hashes: list[int], hold_s: float
    ) -> int:
        """Blocks the peer pins under ``lease_id`` for ``hold_s`` of its time (0 if it
        cannot, or cannot be reached)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers)
        body = {"lease_id": lease_id, "block_hashes": hashes, "hold_s": hold_s}
        timeout = aiohttp.ClientTimeout(total=LEND_TIMEOUT_S)
        try:
            async with self._session.post(
                f"{prefill.url}/kv/lend", json=body, timeout=timeout
            ) as response:
                response.raise_for_status()
                return int((await response.json())["blocks"])
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as error:
            log.warning("peer %s lent nothing: %r", prefill.url, error)
            return 0

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
