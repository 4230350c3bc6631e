"""Simulated GPU time of one engine step: a roofline over the batch's work.

A step costs a fixed CPU overhead plus the larger of its compute time (matmul and
attention FLOPs) and its memory time (weights and KV read from HBM). Prefill adds
FLOPs per *uncached* token, so a prefix-cache hit cuts time to first token through
less prefill work and nothing else. Decode is memory-bound: it pays for streaming the
weights once per step and the KV of every running sequence.

The host tier moves KV over PCIe. Loading blocks back to the GPU delays the step
that needs them: its requests wait for the copy (one transfer per request: a fixed
latency plus the bytes over the link's bandwidth; not overlapped with compute, which
overstates the cost where engines load layer by layer). Demoting blocks to the host
costs no step time: the copy runs on its own stream while the GPU computes, and the
blocks are free the moment it is issued. Whether loading beats recomputing depends on
prompt length: recomputing a short run of tokens hides under the weight read of a
memory-bound step and is nearly free, while a load always pays its latency and bytes.

A profile is its step costs (:class:`StepCosts`, seconds per term) and its capacities.
The built-in ones derive their costs from datasheets (:class:`Roofline`); a profile
file holds costs fitted to a live engine (``prefix-router calibrate``), and every
``--profile`` takes either.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec


def attention_pairs(computed: int, tokens: int) -> float:
    """(query, key) pairs of a prefill chunk of ``tokens`` after ``computed`` ones:
    each new token attends to the computed ones and, causally, to the new ones up to
    itself."""
    return tokens * (computed + (tokens + 1) / 2)


@dataclass(frozen=True)
class BatchShape:
    """The work of one step.

    ``prefill_attention_pairs`` counts (query token, key token) pairs of the prefill
    chunks: a chunk of n new tokens after c computed ones attends to c + (n + 1) / 2
    keys per token on average.
    """

    prefill_seqs: int = 0
    prefill_tokens: int = 0
    prefill_attention_pairs: float = 0.0
    decode_seqs: int = 0
    decode_context_tokens: int = 0
    #: Tokens of KV loaded from the host tier before the step, in ``load_transfers`` copies.
    loaded_tokens: int = 0
    load_transfers: int = 0
    #: LoRA adapters copied from host memory into GPU slots before the step.
    adapter_loads: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    @property
    def num_seqs(self) -> int:
        return self.prefill_seqs + self.decode_seqs


@dataclass(frozen=True)
class HostLink:
    """A link KV is copied over (the GPU's to host memory, or to a peer replica): usable
    bandwidth per direction, latency per copy."""

    name: str
    bytes_per_s: float
    latency_s: float

    def copy_time(self, num_bytes: float, transfers: int = 1) -> float:
        return transfers * self.latency_s + num_bytes / self.bytes_per_s


# PCIe x16 per direction: 4.0 at 16 GT/s and 5.0 at 32 GT/s per lane, 128b/130b
# encoding: 31.5 and 63.0 GB/s (PCI-SIG base specifications 4.0 and 5.0). Packet
# headers and DMA leave about 80% of it to cudaMemcpy from pinned memory (25 to 26 GB/s
# is the usual bandwidthTest figure on Gen4), hence 25 and 50 GB/s. A copy's fixed cost
# (launch and DMA set-up) is taken as 10 us: an assumption, of the order measured for
# cudaMemcpyAsync.
PCIE4 = HostLink("pcie4", bytes_per_s=25e9, latency_s=10e-6)
PCIE5 = HostLink("pcie5", bytes_per_s=50e9, latency_s=10e-6)
LINKS: dict[str, HostLink] = {link.name: link for link in (PCIE4, PCIE5)}


# Links between replicas, for KV pulled from a peer (vLLM's NIXL connector, llm-d,
# Dynamo): per GPU, since each GPU of a tensor-parallel group reads its own shard.
# NVLink 4 moves 450 GB/s per direction per H100 (NVIDIA H100 datasheet: 900 GB/s
# bidirectional); an RDMA NIC (ConnectX-7) 200 or 400 Gb/s, 25 or 50 GB/s on the wire;
# TCP over a 100 GbE NIC, what one UCX TCP stream reaches, taken as 3 GB/s. Usable
# shares (80% of NVLink, 90% of the RDMA wire) and each pull's fixed cost (the
# descriptor exchange and the done notice: 0.1 ms over NVLink, 0.5 ms over RDMA, 1 ms
# over TCP) are assumptions, of the order NIXL's own benchmarks report.
NVLINK = HostLink("nvlink", bytes_per_s=360e9, latency_s=0.1e-3)
RDMA200 = HostLink("rdma200", bytes_per_s=22.5e9, latency_s=0.5e-3)
RDMA400 = HostLink("rdma400", bytes_per_s=45e9, latency_s=0.5e-3)
TCP = HostLink("tcp", bytes_per_s=3e9, latency_s=1e-3)
PEER_LINKS: dict[str, HostLink] = {link.name: link for link in (NVLINK, RDMA200, RDMA400, TCP)}


def get_peer_link(name: str) -> HostLink:
    """A named link between replicas, or a usable bandwidth in GB/s (``"10"``)."""
    if name in PEER_LINKS:
        return PEER_LINKS[name]
    try:
        return get_link(name)
    except ValueError:
        known = ", ".join(PEER_LINKS)
        raise ValueError(f"unknown peer link {name!r}; known: {known}, or GB/s") from None


def get_link(name: str) -> HostLink:
    """A named link, or a usable bandwidth in GB/s (``"40"``: 40 GB/s, 10 us a copy)."""
    if name in LINKS:
        return LINKS[name]
    try:
        gb_per_s = float(name)
    except ValueError:
        known = ", ".join(LINKS)
        raise ValueError(f"unknown host link {name!r}; known: {known}, or GB/s") from None
    if gb_per_s <= 0:
        raise ValueError(f"a host link's bandwidth must be positive, got {name!r}")
    return HostLink(f"{gb_per_s:g}GB/s", bytes_per_s=gb_per_s * 1e9, latency_s=PCIE5.latency_s)


@dataclass(frozen=True)
class StepCosts:
    """Seconds one engine step costs, term by term: what a profile says of an engine,
    whether derived from a GPU's datasheet (:class:`Roofline`) or fitted to a live one
    (``prefix-router calibrate``, ``replica/calibration.py``).

    A step costs its fixed and per-sequence overheads plus the larger of its compute
    (linear layers per token, the LM head per sequence, attention per (query, key)
    pair) and its memory floor (the weights read once a step, the KV of every decode
    sequence read). An engine that is compute-bound at every batch (a CPU) has no floor.
    """

    step_s: float
    seq_s: float
    token_s: float
    attention_pair_s: float
    lm_head_s: float = 0.0
    weights_s: float = 0.0
    kv_token_s: float = 0.0

    def __post_init__(self) -> None:
        negative = [name for name, value in vars(self).items() if value < 0]
        if negative:
            raise ValueError(f"step costs must not be negative: {', '.join(negative)}")

    def time(self, tokens: int, seqs: int, attention_pairs: float, kv_read_tokens: int) -> float:
        compute = (
            self.token_s * tokens + self.lm_head_s * seqs + self.attention_pair_s * attention_pairs
        )
        memory = self.weights_s + self.kv_token_s * kv_read_tokens
        return self.step_s + self.seq_s * seqs + max(compute, memory)


@dataclass(frozen=True)
class CostProfile:
    """One engine's step costs and its capacities: what the simulated replica and the
    replayer time steps with and size their caches by."""

    name: str
    costs: StepCosts
    kv_bytes_per_token: int
    weight_bytes: float
    #: The GPUs' link to host memory (each GPU of a tensor-parallel group has its own:
    #: ``num_gpus`` links share a copy).
    host_link: HostLink = PCIE5
    num_gpus: int = 1
    #: HBM per GPU; with ``gpu_memory_utilization`` of it for weights and KV (vLLM's
    #: default 0.9), it sets how many KV blocks the GPUs hold.
    gpu_memory_bytes: float = 80e9
    gpu_memory_utilization: float = 0.9
    #: Host memory per GPU given to the KV tier by default: a DGX H100 has 2 TB of system
    #: memory for 8 GPUs (NVIDIA DGX H100 datasheet), a DGX A100 1 TB.
    host_memory_bytes: float = 256e9
    #: Tokens of KV the engine was measured to hold (vLLM's ``num_gpu_blocks`` times its
    #: block size); ``None``: derived from the memory above.
    kv_tokens: int | None = None
    #: Seconds a request spends outside the engine's steps (the API server's HTTP,
    #: tokenizing, detokenizing), as calibrated. The replayer adds it to every request's
    #: times; a live simulated replica pays its own instead.
    request_s: float = 0.0
    #: Bytes of a LoRA adapter per unit of rank, over every linear layer (0: no
    #: adapters modelled); one of ``lora_rank`` is copied into a GPU slot on first use.
    lora_bytes_per_rank: float = 0.0
    lora_rank: int = 16

    def step_time(self, batch: BatchShape, link: HostLink | None = None) -> float:
        """Seconds of GPU time for ``batch``; 0 for an empty batch."""
        if batch.num_tokens == 0:
            return 0.0
        compute = self.costs.time(
            batch.num_tokens,
            batch.num_seqs,
            batch.prefill_attention_pairs + batch.decode_context_tokens,
            batch.decode_context_tokens,
        )
        if batch.adapter_loads:
            compute += batch.adapter_loads * self.adapter_load_time(link)
        if not batch.loaded_tokens:
            return compute
        return compute + self.load_time(batch.loaded_tokens, batch.load_transfers, link)

    def adapter_load_time(self, link: HostLink | None = None) -> float:
        """Seconds to copy one LoRA adapter from host memory into a GPU slot (vLLM keeps
        registered adapters in host memory and copies one in when a batch first needs it;
        each GPU of a tensor-parallel group copies its shard)."""
        link = link or self.host_link
        return link.copy_time(self.lora_rank * self.lora_bytes_per_rank / self.num_gpus)

    def load_time(self, tokens: int, transfers: int = 1, link: HostLink | None = None) -> float:
        """Seconds to copy ``tokens`` of KV from host memory to the GPUs."""
        link = link or self.host_link
        return link.copy_time(tokens * self.kv_bytes_per_token / self.num_gpus, transfers)

    def transfer_time(self, tokens: int, link: HostLink) -> float:
        """Seconds to pull ``tokens`` of KV from a peer over ``link`` (one pull; each
        GPU of a tensor-parallel group pulls its shard over its own link)."""
        return link.copy_time(tokens * self.kv_bytes_per_token / self.num_gpus) if tokens else 0.0

    def prefill_time(self, computed: int, tokens: int) -> float:
        """Seconds to prefill ``tokens`` after ``computed`` ones, alone in a step."""
        pairs = attention_pairs(computed, tokens)
        return self.costs.time(tokens, 1, pairs, 0) if tokens else 0.0

    def load_beats_recompute(
        self, host_tokens: int, computed: int, remaining: int, link: HostLink | None = None
    ) -> bool:
        """Whether loading ``host_tokens`` (after ``computed`` cached ones, with
        ``remaining`` to compute after them) costs less than computing them too."""
        recompute = self.prefill_time(computed, host_tokens + remaining) - self.prefill_time(
            computed + host_tokens, remaining
        )
        return self.load_time(host_tokens, 1, link) < recompute

    def kv_blocks(self, block_size: int) -> int:
        """KV blocks the engine holds: as measured, or what the GPUs hold after the
        weights (as vLLM sizes its pool)."""
        if self.kv_tokens is not None:
            return self.kv_tokens // block_size
        usable = self.num_gpus * self.gpu_memory_bytes * self.gpu_memory_utilization
        return int((usable - self.weight_bytes) // (self.kv_bytes_per_token * block_size))

    def host_blocks(self, block_size: int) -> int:
        """KV blocks the profile's typical host memory holds."""
        return int(self.num_gpus * self.host_memory_bytes // (self.kv_bytes_per_token * block_size))

    def decode_step_times(
        self, num_seqs: int, context_tokens: int, num_steps: int
    ) -> Iterator[float]:
        """Durations of ``num_steps`` decode-only steps; every step adds a token per
        sequence. Lazy: a caller may stop early."""
        for context in range(context_tokens, context_tokens + num_steps * num_seqs, num_seqs):
            yield self.costs.time(num_seqs, num_seqs, context, context)

    def save(self, path: Path) -> None:
        """Write the profile where ``--profile PATH`` reads it."""
        path.write_bytes(msgspec.json.format(msgspec.json.encode(self)))


@dataclass(frozen=True)
class Roofline:
    """A model on a GPU, by their datasheets and measured kernel efficiencies: the
    constants its :class:`StepCosts` are derived from. See each profile below for
    sources.

    The linear layers cost 2 FLOPs per parameter per token, except the embedding (a
    lookup) and the LM head, which prefill runs on each sequence's last token only.
    Attention has an efficiency of its own: its kernels reach a different fraction
    of peak than the GEMMs do, and the fraction differs by GPU.
    """

    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    vocab_size: int
    kv_bytes_per_token: int
    weight_bytes: float
    peak_flops: float
    hbm_bytes_per_s: float
    compute_efficiency: float
    attention_efficiency: float
    memory_efficiency: float
    #: Decode attention streams each sequence's KV in long reads, nearer peak
    #: bandwidth than the many GEMMs' weight reads.
    kv_read_efficiency: float
    step_overhead_s: float
    seq_overhead_s: float
    host_link: HostLink = PCIE5
    num_gpus: int = 1
    gpu_memory_bytes: float = 80e9
    host_memory_bytes: float = 256e9
    #: Per unit of LoRA rank, every linear layer's A and B matrices: rank x (inputs +
    #: outputs) parameters each, in the weights' bytes.
    lora_bytes_per_rank: float = 0.0

    def __post_init__(self) -> None:
        efficiencies = (
            self.compute_efficiency,
            self.attention_efficiency,
            self.memory_efficiency,
            self.kv_read_efficiency,
        )
        if not all(0 < e <= 1 for e in efficiencies):
            raise ValueError("efficiencies must lie in (0, 1]")

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def profile(self) -> CostProfile:
        gemm_flops_s = self.peak_flops * self.compute_efficiency
        attention_flops_s = self.peak_flops * self.attention_efficiency
        bytes_s = self.hbm_bytes_per_s * self.memory_efficiency
        bytes_per_param = self.weight_bytes / self.num_params
        # Untied embeddings: the table and the LM head are the same size.
        layer_params = self.num_params - 2 * self.lm_head_params
        costs = StepCosts(
            step_s=self.step_overhead_s,
            seq_s=self.seq_overhead_s,
            token_s=2 * layer_params / gemm_flops_s,
            attention_pair_s=4 * self.num_layers * self.hidden_size / attention_flops_s,
            lm_head_s=2 * self.lm_head_params / gemm_flops_s,
            # A decode step reads every weight but the embedding table's unused rows.
            weights_s=(self.num_params - self.lm_head_params) * bytes_per_param / bytes_s,
            kv_token_s=self.kv_bytes_per_token / (self.hbm_bytes_per_s * self.kv_read_efficiency),
        )
        return CostProfile(
            self.name,
            costs,
            self.kv_bytes_per_token,
            self.weight_bytes,
            self.host_link,
            self.num_gpus,
            self.gpu_memory_bytes,
            host_memory_bytes=self.host_memory_bytes,
            lora_bytes_per_rank=self.lora_bytes_per_rank,
        )

    def layers_only(self) -> Roofline:
        """The transformer layers alone, as Vidur times a model: no embedding, no LM
        head, no step overhead. The per-sequence cost stays: it stands as much for the
        GEMMs' time growing with the batch in a memory-bound step (Vidur's A100 layer:
        0.30 to 0.35 ms from 1 to 64 tokens, 24 us a sequence over 32 layers) as for
        the CPU's work per sequence."""
        layer_params = self.num_params - 2 * self.lm_head_params
        return replace(
            self,
            num_params=layer_params,
            vocab_size=0,
            step_overhead_s=0.0,
            weight_bytes=self.weight_bytes * layer_params / self.num_params,
        )


def _llama3_kv_bytes(num_layers: int) -> int:
    # K and V, 8 KV heads of dimension 128, bf16 (2 bytes): Llama-3 GQA config.
    return 2 * num_layers * 8 * 128 * 2


def _llama3_lora_bytes_per_rank(num_layers: int, hidden: int, intermediate: int) -> float:
    # A LoRA on every linear layer (q, k, v, o, gate, up, down), bf16: each adds rank x
    # (inputs + outputs) parameters; K and V project to 8 heads of 128.
    kv = 8 * 128
    attention = 2 * (hidden + hidden) + 2 * (hidden + kv)
    mlp = 3 * (hidden + intermediate)
    return 2.0 * num_layers * (attention + mlp)


# Llama-3-8B: 32 layers, hidden 4096, 8 KV heads, vocabulary 128,256 (model config, as
# mirrored in microsoft/vidur data/model_configs/meta-llama/Meta-Llama-3-8B.yml);
# 8.03e9 parameters, derived from that config with untied embeddings.
# H100 SXM5: 989.4 dense BF16 TFLOPS and 3.35 TB/s HBM3, 80 GB, PCIe Gen5 x16 to the
# host (NVIDIA H100 datasheet).
# Efficiencies, from Vidur's per-operator kernel times (benchmarks/data/vidur): the
# layers' GEMMs run at 57 to 67% of peak from 512 tokens up (its H100 Llama-2-7B
# profile, taken as 60%; 64 to 67% on A100), batch-1 decode reads the weights at 69%
# of peak bandwidth (70% on A100) and decode attention reads KV at 78% (A100).
# Attention: FlashAttention-2-class kernels reach about 35% of an H100's peak
# (FlashAttention-3 paper, Shah et al. 2024, arXiv 2407.08608); Vidur's A100
# FlashInfer rows reach 55% on long prompts.
# Overheads: vLLM V1 overlaps the CPU's scheduling with the GPU's step (asynchronous
# scheduling, CUDA graphs for decode): about 6.5 ms per output token at batch 1 on an
# H100, nearly all of it the weight read, so 0.1 ms per step plus 20 us per sequence
# (Vidur's cpu_overheads.csv measured ~2 ms per step for vLLM v0).
LLAMA3_8B_H100 = Roofline(
    name="llama3-8b-h100",
    num_params=8.03e9,
    num_layers=32,
    hidden_size=4096,
    vocab_size=128256,
    kv_bytes_per_token=_llama3_kv_bytes(32),
    weight_bytes=2 * 8.03e9,
    peak_flops=989.4e12,
    hbm_bytes_per_s=3.35e12,
    compute_efficiency=0.60,
    attention_efficiency=0.35,
    memory_efficiency=0.69,
    kv_read_efficiency=0.78,
    step_overhead_s=0.1e-3,
    seq_overhead_s=20e-6,
    # intermediate size 14,336: a rank-16 adapter is 84 MB, 1.7 ms over PCIe 5
    lora_bytes_per_rank=_llama3_lora_bytes_per_rank(32, 4096, 14336),
)

# The same model on an A100 SXM 80GB: 312 dense BF16 TFLOPS, 2.039 TB/s HBM2e, PCIe
# Gen4 x16 to the host (NVIDIA A100 datasheet); efficiencies measured on this GPU by
# Vidur (see above).
LLAMA3_8B_A100 = replace(
    LLAMA3_8B_H100,
    name="llama3-8b-a100",
    peak_flops=312e12,
    hbm_bytes_per_s=2.039e12,
    compute_efficiency=0.67,
    attention_efficiency=0.55,
    memory_efficiency=0.70,
    host_link=PCIE4,
    host_memory_bytes=128e9,
)

# Llama-3-70B on 4 H100s with tensor parallelism: 80 layers, hidden 8192, 8 KV heads,
# vocabulary 128,256 (Vidur's Meta-Llama-3-70B.yml), 70.55e9 parameters. Weights and
# KV heads are split over the four GPUs, so whole-model bytes over four GPUs'
# bandwidth give the time; lower efficiencies and a larger step overhead stand for
# tensor parallelism's all-reduces and its broadcast of each step to the workers
# (assumed).
LLAMA3_70B_4XH100 = Roofline(
    name="llama3-70b-4xh100",
    num_params=70.55e9,
    num_layers=80,
    hidden_size=8192,
    vocab_size=128256,
    kv_bytes_per_token=_llama3_kv_bytes(80),
    weight_bytes=2 * 70.55e9,
    peak_flops=4 * 989.4e12,
    hbm_bytes_per_s=4 * 3.35e12,
    compute_efficiency=0.60,
    attention_efficiency=0.30,
    memory_efficiency=0.65,
    kv_read_efficiency=0.70,
    step_overhead_s=0.5e-3,
    seq_overhead_s=20e-6,
    num_gpus=4,
    lora_bytes_per_rank=_llama3_lora_bytes_per_rank(80, 8192, 28672),
)

ROOFLINES: dict[str, Roofline] = {
    r.name: r for r in (LLAMA3_8B_H100, LLAMA3_8B_A100, LLAMA3_70B_4XH100)
}
PROFILES: dict[str, CostProfile] = {name: r.profile() for name, r in ROOFLINES.items()}

CostFn = Callable[[BatchShape], float]


def get_profile(name: str) -> CostProfile:
    """A built-in profile by name, or a profile file (``prefix-router calibrate``
    writes them) by its path."""
    if name in PROFILES:
        return PROFILES[name]
    if name.endswith(".json") or "/" in name:
        return _read_profile(Path(name))
    known = ", ".join(PROFILES)
    raise ValueError(f"unknown cost profile {name!r}; known: {known}, or a profile file's path")


def _read_profile(path: Path) -> CostProfile:
    try:
        modified = path.stat().st_mtime_ns
    except FileNotFoundError:
        raise ValueError(f"cost profile file {str(path)!r} does not exist") from None
    return _decode_profile(path, modified)


@functools.cache  # a replay builds an engine per replica: the file is read once
def _decode_profile(path: Path, modified_ns: int) -> CostProfile:
    try:
        return msgspec.json.decode(path.read_bytes(), type=CostProfile)
    except msgspec.ValidationError as error:
        raise ValueError(f"{path}: not a cost profile ({error})") from None
    except msgspec.DecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
