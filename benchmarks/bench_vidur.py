"""The built-in cost profiles against Vidur's published per-operator profiles.

Vidur (microsoft/vidur, MLSys 2024) profiles every operator of a transformer layer on
real GPUs; its model time of a batch is the sum over a layer's operators, times the
number of layers, with no embedding, LM head or CPU overhead (its
``execution_time.py``). The rows used are kept in ``benchmarks/data/vidur`` (MIT;
their source in ``SOURCE.md``), so this runs offline:

    python -m benchmarks.bench_vidur

It prints, for Llama-3-8B on an A100 (Vidur's profile) and an H100 (derived op by
op from Vidur's H100 Llama-2-7B rows: :func:`derived_h100`), prefill and decode steps
as our ``replica/api/cost_model.py`` times them, whole and for the layers alone, beside
Vidur's, and their ratio. Vidur profiles chunks up to 16,384 tokens (32k is
extrapolated) and prefixes only in multiples of the chunk: "6,656 after 1,536
cached" interpolates its attention linearly between the chunk's rows with no prefix
and with a 6,656-token prefix.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

from replica.api.cost_model import LLAMA3_8B_A100, LLAMA3_8B_H100, Roofline

DATA = Path(__file__).parent / "data" / "vidur"
LAYERS = 32  # Llama-3-8B

#: The operators outside attention that Vidur sums per layer (execution_time.py).
LINEAR_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
ATTENTION_OPS = ("attn_prefill", "attn_decode")
#: Vidur adds the KV cache's write as measured: 0.55 us a token in prefill (4.6 ms a
#: layer at 8k tokens, more than its attention), far above the 4 KiB a token cost at
#: HBM bandwidth, so the table shows Vidur with and without it.
KV_SAVE = "attn_kv_cache_save"


@dataclass(frozen=True)
class VidurProfile:
    """Per-layer milliseconds: linear operators by batch tokens, attention by its key."""

    linear_ms: dict[int, float]
    #: (is_prefill, batch_size, prefill_chunk_size, kv_cache_size) -> milliseconds.
    attention_ms: dict[tuple[bool, int, int, int], float]
    kv_save_ms: dict[tuple[bool, int, int, int], float]

    def prefill_s(self, cached: int, tokens: int, kv_save: bool = True) -> float:
        def at(key: tuple[bool, int, int, int]) -> float:
            return self.attention_ms[key] + (self.kv_save_ms[key] if kv_save else 0.0)

        largest = max(chunk for _, _, chunk, _ in self.attention_ms)
        if (True, 1, tokens, cached) in self.attention_ms:
            attention = at((True, 1, tokens, cached))
        elif tokens > largest and not cached:  # quadratic in the chunk, as Vidur fits it
            attention = at((True, 1, largest, 0)) * (tokens / largest) ** 2
        else:  # linear in the prefix between the rows Vidur has for this chunk
            bare, full = at((True, 1, tokens, 0)), at((True, 1, tokens, tokens))
            attention = bare + (full - bare) * cached / tokens
        return LAYERS * (self.linear(tokens) + attention) / 1e3

    def linear(self, tokens: int) -> float:
        """A row's time, or the largest row's scaled by tokens (GEMMs at full size
        are linear in them)."""
        if tokens in self.linear_ms:
            return self.linear_ms[tokens]
        largest = max(self.linear_ms)
        return self.linear_ms[largest] * tokens / largest

    def decode_s(self, batch: int, context: int, kv_save: bool = True) -> float:
        key = (False, batch, 0, context)
        attention = self.attention_ms[key] + (self.kv_save_ms[key] if kv_save else 0.0)
        return LAYERS * (self.linear(batch) + attention) / 1e3


def load_vidur(prefix: str) -> VidurProfile:
    """Measured twice, a key's medians are averaged."""
    linear: dict[int, list[float]] = defaultdict(list)
    with open(DATA / f"{prefix}_mlp.csv") as rows:
        for row in csv.DictReader(rows):
            ops = sum(float(row[f"time_stats.{op}.median"]) for op in LINEAR_OPS)
            linear[int(row["num_tokens"])].append(ops)
    attention: dict[tuple[bool, int, int, int], list[float]] = defaultdict(list)
    kv_save: dict[tuple[bool, int, int, int], list[float]] = defaultdict(list)
    with open(DATA / f"{prefix}_attention.csv") as rows:
        for row in csv.DictReader(rows):
            key = (
                row["is_prefill"] == "True",
                int(row["batch_size"]),
                int(row["prefill_chunk_size"]),
                int(row["kv_cache_size"]),
            )
            ops = sum(float(row[f"time_stats.{op}.median"]) for op in ATTENTION_OPS)
            attention[key].append(ops)
            kv_save[key].append(float(row[f"time_stats.{KV_SAVE}.median"]))
    return VidurProfile(*({k: mean(v) for k, v in d.items()} for d in (linear, attention, kv_save)))


def derived_h100(a100: VidurProfile, h100_llama2: dict[str, dict[int, float]]) -> VidurProfile:
    """Llama-3-8B on an H100, derived op by op: Vidur has it on A100 only, and Llama-2-7B
    on H100 (MLP rows only: its H100 attention rows were not found).

    Each linear operator's Llama-2-7B time scales with its weight matrix's size
    (Llama-3-8B's QKV projection is half Llama-2-7B's under GQA, its MLP 1.30 times):
    at a fixed token count a GEMM's FLOPs and its bytes both scale so. Attention is
    A100's, over the ratio of attention throughput: long prefill at FlashAttention-2's
    35% of an H100's peak against the 55% Vidur's rows reach on A100, and decode (which
    reads KV) over the ratio of HBM bandwidths. The attention rows are therefore a
    derivation from the same sources the profile's attention efficiency comes from,
    not an independent check; the linear rows are one.
    """
    linear = {
        tokens: sum(H100_WEIGHT_RATIO[op] * h100_llama2[op][tokens] for op in LINEAR_OPS)
        for tokens in h100_llama2["add"]
    }
    prefill_scale = (312e12 * 0.55) / (989.4e12 * 0.35)
    decode_scale = 2.039e12 / 3.35e12

    def scaled(times: dict[tuple[bool, int, int, int], float]) -> dict:
        return {k: t * (prefill_scale if k[0] else decode_scale) for k, t in times.items()}

    return VidurProfile(linear, scaled(a100.attention_ms), scaled(a100.kv_save_ms))


#: Llama-3-8B's weight over Llama-2-7B's, per operator (their configs in SOURCE.md):
#: QKV 4096 x (4096 + 2 x 1024) against 4096 x 3 x 4096; rotary over 32 + 8 heads
#: against 32 + 32; MLP hidden 14,336 against 11,008; the rest the same shape.
H100_WEIGHT_RATIO = {
    "input_layernorm": 1.0,
    "attn_pre_proj": 6144 / 12288,
    "attn_rope": 40 / 64,
    "attn_post_proj": 1.0,
    "post_attention_layernorm": 1.0,
    "mlp_up_proj": 14336 / 11008,
    "mlp_act": 14336 / 11008,
    "mlp_down_proj": 14336 / 11008,
    "add": 1.0,
}


def load_ops(path: Path) -> dict[str, dict[int, float]]:
    """Each operator's median by token count (rows measured twice averaged)."""
    ops: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    with open(path) as rows:
        for row in csv.DictReader(rows):
            for op in LINEAR_OPS:
                ops[op][int(row["num_tokens"])].append(float(row[f"time_stats.{op}.median"]))
    return {op: {n: mean(v) for n, v in by.items()} for op, by in ops.items()}


#: (label, cached, new tokens) and (label, batch, context per sequence).
PREFILLS = [
    ("512", 0, 512),
    ("2k", 0, 2048),
    ("8k", 0, 8192),
    ("16k", 0, 16384),
    ("32k", 0, 32768),
    ("8k after 1.5k cached", 1536, 6656),
]
DECODES = [(f"batch {b}, {c // 1024}k context", b, c) for c in (1024, 8192) for b in (1, 16, 64)]


@dataclass(frozen=True)
class Row:
    label: str
    #: Our step: the whole model with its overheads; the layers alone, as Vidur times it.
    ours_s: float
    ours_layers_s: float
    vidur_s: float
    vidur_unsaved_s: float

    @property
    def ratio(self) -> float:
        return self.ours_layers_s / self.vidur_unsaved_s


def comparison(ours: Roofline, vidur: VidurProfile) -> list[Row]:
    """Each step timed by the profile (whole, and its layers alone) and by Vidur (with
    and without its KV-cache write)."""
    whole, layers = ours.profile(), ours.layers_only().profile()
    rows = [
        Row(
            f"prefill {label}",
            whole.prefill_time(c, n),
            layers.prefill_time(c, n),
            vidur.prefill_s(c, n),
            vidur.prefill_s(c, n, kv_save=False),
        )
        for label, c, n in PREFILLS
    ]
    rows += [
        Row(
            f"decode {label}",
            next(whole.decode_step_times(b, b * c, 1)),
            next(layers.decode_step_times(b, b * c, 1)),
            vidur.decode_s(b, c),
            vidur.decode_s(b, c, kv_save=False),
        )
        for label, b, c in DECODES
    ]
    return rows


def vidur_profiles() -> dict[str, tuple[Roofline, VidurProfile]]:
    a100 = load_vidur("a100_llama3_8b")
    h100 = derived_h100(a100, load_ops(DATA / "h100_llama2_7b_mlp.csv"))
    return {
        "A100 (Vidur's profile)": (LLAMA3_8B_A100, a100),
        "H100 (derived from Vidur's Llama-2-7B)": (LLAMA3_8B_H100, h100),
    }


def main() -> None:
    for gpu, (roofline, vidur) in vidur_profiles().items():
        print(f"\nLlama-3-8B on an {gpu}: {roofline.name}, ms per step")
        print(f"{'step':<30}{'ours':>9}{'layers':>9}{'Vidur':>9}{'no KV save':>12}{'ratio':>7}")
        for row in comparison(roofline, vidur):
            times = (row.ours_s, row.ours_layers_s, row.vidur_s)
            print(
                f"{row.label:<30}"
                + "".join(f"{t * 1e3:>9.2f}" for t in times)
                + f"{row.vidur_unsaved_s * 1e3:>12.2f}{row.ratio:>7.2f}"
            )
    print("\nVidur's figures are GPU kernel time of the 32 layers, without embedding, LM head")
    print("or CPU overhead: 'layers' is our step so (the ratio is layers over Vidur without")
    print("its KV save); 'ours' is the whole step the replayer times, overheads included.")
    print("32k: Vidur profiles chunks up to 16k; its 32k attention is the 16k row times 4.")


if __name__ == "__main__":
    main()
