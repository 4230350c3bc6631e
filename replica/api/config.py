"""A replica's configuration: the shape of its engine and how fast simulated time runs.

It is part of the contract because a replica reports it in ``/stats``: the bench
reads it to build the replica's simulated twin, and deployments pass it to every
replica they start. The engine checks the rest (such as the profile's name) when it
is built from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replica.api.identity import DEFAULT_BLOCK_SIZE, DEFAULT_MODEL
from replica.api.tokenizer import DEFAULT_TOKENIZER

#: Llama-3-8B on one H100 (see ``replica/api/cost_model.py`` for the sources).
DEFAULT_PROFILE = "llama3-8b-h100"
#: What a replica does in a disaggregated fleet (``both``: an aggregated replica).
ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class ReplicaConfig:
    """A replica: its engine's shape and how fast simulated time runs."""

    model: str = DEFAULT_MODEL
    #: GPU KV blocks; by default what the profile's GPUs hold after the weights, as
    #: vLLM sizes its pool (Llama-3-8B on one H100: 26,674 blocks of 16 tokens).
    num_blocks: int | None = field(default=None, metadata={"derived": "the profile's GPUs"})
    block_size: int = DEFAULT_BLOCK_SIZE
    profile: str = DEFAULT_PROFILE
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    #: Simulated GPU time runs this many times faster than the wall clock.
    speedup: float = 1.0
    seed: int = 0
    #: Blocks of the host-memory KV tier under the GPU's; by default what the profile's
    #: typical host memory holds (256 GB per H100: 122,070 blocks); 0: no host tier.
    host_blocks: int | None = field(default=None, metadata={"derived": "the profile's host"})
    #: The GPU's link to host memory: ``pcie4``, ``pcie5``, or its usable bandwidth in
    #: GB/s (``40``); empty: the profile's.
    host_link: str = field(default="", metadata={"derived": "the profile's"})
    #: ``bytes4`` (the simulated model's) or a Hugging Face ``tokenizer.json`` or its
    #: folder; ``chat_template``: a Jinja file or text replacing the tokenizer's own.
    tokenizer: str = DEFAULT_TOKENIZER
    chat_template: str = field(default="", metadata={"derived": "the tokenizer's"})
    #: LoRA adapters served from the start, comma-separated names (requests name one as
    #: their ``model``; more are loaded with ``POST /v1/load_lora_adapter``), and how
    #: many one batch may use at once (vLLM's ``--lora-modules``, ``--max-loras``).
    lora_modules: str = ""
    max_loras: int = 1
    #: Engines behind its one server, each with a KV cache, a load and KV-event sockets
    #: of its own (vLLM's ``--data-parallel-size``): a request names one with the
    #: ``X-data-parallel-rank`` header, else goes to the least loaded; rank R publishes
    #: where rank 0 does, each port plus R, its batches marked with its rank.
    data_parallel_size: int = 1
    #: What it does for a disaggregated fleet: ``both`` (prefill and decode, as every
    #: replica did before), ``prefill`` or ``decode``; the gateway reads it from /stats.
    role: str = "both"
    #: The link it pulls peers' KV over: ``nvlink``, ``rdma200``, ``rdma400``, ``tcp``
    #: or GB/s (replica/kv_transfer.py).
    peer_link: str = "rdma200"
    #: Seconds a prefill holds a prompt's blocks for its decode replica to pull (vLLM's
    #: NIXL connector frees them after ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s).
    kv_hold_s: float = 30.0

    @property
    def adapters(self) -> tuple[str, ...]:
        return tuple(name for name in self.lora_modules.split(",") if name)

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise ValueError("speedup must be positive")
        if self.kv_hold_s < 0:
            raise ValueError(f"kv_hold_s must not be negative, got {self.kv_hold_s}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        positive = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in (*positive, "data_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.host_blocks is not None and self.host_blocks < 0:
            raise ValueError(f"host_blocks must not be negative, got {self.host_blocks}")
