"""A replica's configuration: the shape of its engine and how fast simulated time runs.

It is part of the contract because a replica reports it in ``/stats``: the bench
reads it to build the replica's simulated twin, and deployments pass it to every
replica they start. The engine checks the rest (such as the profile's name) when it
is built from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from replica.api.identity import DEFAULT_BLOCK_SIZE, DEFAULT_MODEL

#: Llama-3-8B on one H100 (see ``replica/cost_model.py`` for the sources).
DEFAULT_PROFILE = "llama3-8b-h100"


@dataclass(frozen=True)
class ReplicaConfig:
    """A replica: its engine's shape and how fast simulated time runs."""

    model: str = DEFAULT_MODEL
    num_blocks: int = 4096
    block_size: int = DEFAULT_BLOCK_SIZE
    profile: str = DEFAULT_PROFILE
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    #: Simulated GPU time runs this many times faster than the wall clock.
    speedup: float = 1.0
    seed: int = 0
    #: Blocks of the host-memory KV tier under the GPU's (0: none), and the GPU's link
    #: to it (``pcie4``, ``pcie5``; empty: the profile's).
    host_blocks: int = 0
    host_link: str = ""

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise ValueError("speedup must be positive")
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
