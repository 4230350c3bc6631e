"""A server of several engines (``--data-parallel-size N``), as vLLM runs one.

Each engine is a :class:`~replica.service.Replica` of its own: its KV cache, its loop
and counters, its KV events and load on sockets of its own, rank R's where rank 0's
are, each port plus R, its batches marked with its rank. The server in front
(replica/server.py) sends a completion to the engine its ``X-data-parallel-rank``
header names, else to the least loaded, as vLLM's own balancer does; a reset or an
adapter goes to every engine; what one engine says (``/stats``, ``/metrics``,
``/kv_events``) is the named engine's, rank 0's without the header.
"""

from __future__ import annotations

from replica.api import openai as api
from replica.api.config import ReplicaConfig
from replica.service import Replica


class EngineRanks:
    """The engines behind one server: one, or ``config.data_parallel_size``."""

    def __init__(self, config: ReplicaConfig, fleet_token: str = "") -> None:
        size = config.data_parallel_size
        first = Replica(config, fleet_token, rank=0 if size > 1 else None)
        tokenizer = first.engine.tokenizer  # one tokenizer (and piece cache) for all
        others = [Replica(config, fleet_token, r, tokenizer) for r in range(1, size)]
        self.all = [first, *others]

    def __getitem__(self, rank: int) -> Replica:
        return self.all[rank]

    def named(self, header: str | None) -> Replica:
        """The engine ``header`` names (none: rank 0); 400 for a rank it has not."""
        if header is None:
            return self.all[0]
        if not header.isdigit() or int(header) >= len(self.all):
            ranks = f"0 to {len(self.all) - 1}" if len(self.all) > 1 else "0"
            raise api.Rejected(f"no data-parallel rank {header!r} here: its ranks are {ranks}")
        return self.all[int(header)]

    def chosen(self, header: str | None) -> Replica:
        """Where a completion goes: the engine ``header`` names, else the least loaded."""
        if header is not None or len(self.all) == 1:
            return self.named(header)
        return min(self.all, key=lambda replica: replica.load)

    async def start(self, host: str | None) -> None:
        endpoint = await self.all[0].start(host)
        for rank, replica in enumerate(self.all[1:], start=1):
            await replica.start(host, endpoint.of_rank(rank) if endpoint else None)

    async def stop(self) -> None:
        for replica in self.all:
            await replica.stop()

    def reset(self) -> bool:
        """Empty every engine's cache; ``False`` if one had requests running."""
        return all([replica.reset() for replica in self.all])  # each asked: no short cut

    @property
    def load(self) -> int:
        return sum(replica.load for replica in self.all)
