"""The built-in A100 cost profile against Vidur's published per-operator profiles.

Vidur (microsoft/vidur, MLSys 2024) profiles every operator of a transformer layer on
real GPUs; its model time of a batch is the sum over a layer's operators, times the
number of layers, with no embedding, LM head or CPU overhead (its
``execution_time.py``). The rows used are kept in ``benchmarks/data/vidur`` (MIT;
their source in ``SOURCE.md``), so this runs offline:

    python -m benchmarks.bench_vidur

It prints, for Llama-3-8B on an A100, prefill and decode steps as our
``replica/cost_model.py`` times them and as Vidur's profile does, and their ratio.
Vidur profiles chunks up to 16,384 tokens (no 32k row) and prefixes only in
multiples of the chunk: "6,656 after 1,536 cached" interpolates its attention
linearly between the chunk's rows with no prefix and with a 6,656-token prefix.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

from replica.cost_model import LLAMA3_8B_A100, CostProfile

DATA = Path(__file__).parent / "data" / "vidur"
LAYERS = 32  # Llama-3-8B

#: The operators outside attention that Vidur sums per layer (execution_time.py).
LINEAR_OPS = (
    "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
    "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add",
)  # fmt: skip
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

        if (True, 1, tokens, cached) in self.attention_ms:
            attention = at((True, 1, tokens, cached))
        else:  # linear in the prefix between the rows Vidur has for this chunk
            bare, full = at((True, 1, tokens, 0)), at((True, 1, tokens, tokens))
            attention = bare + (full - bare) * cached / tokens
        return LAYERS * (self.linear_ms[tokens] + attention) / 1e3

    def decode_s(self, batch: int, context: int, kv_save: bool = True) -> float:
        key = (False, batch, 0, context)
        attention = self.attention_ms[key] + (self.kv_save_ms[key] if kv_save else 0.0)
        return LAYERS * (self.linear_ms[batch] + attention) / 1e3


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
            key = (row["is_prefill"] == "True", int(row["batch_size"]),
                   int(row["prefill_chunk_size"]), int(row["kv_cache_size"]))  # fmt: skip
            ops = sum(float(row[f"time_stats.{op}.median"]) for op in ATTENTION_OPS)
            attention[key].append(ops)
            kv_save[key].append(float(row[f"time_stats.{KV_SAVE}.median"]))
    return VidurProfile(*({k: mean(v) for k, v in d.items()} for d in (linear, attention, kv_save)))


#: (label, cached, new tokens) and (label, batch, context per sequence).
PREFILLS = [("512", 0, 512), ("2k", 0, 2048), ("8k", 0, 8192), ("16k", 0, 16384),
            ("8k after 1.5k cached", 1536, 6656)]  # fmt: skip
DECODES = [(f"batch {b}, {c // 1024}k context", b, c) for c in (1024, 8192) for b in (1, 16, 64)]


def comparison(ours: CostProfile) -> list[tuple[str, float, float, float]]:
    """Each step: its label, our seconds, Vidur's, and Vidur's without the KV save."""
    vidur = load_vidur("a100_llama3_8b")
    rows = [(f"prefill {label}", ours.prefill_time(c, n), vidur.prefill_s(c, n),
             vidur.prefill_s(c, n, kv_save=False)) for label, c, n in PREFILLS]  # fmt: skip
    rows += [(f"decode {label}", next(ours.decode_step_times(b, b * c, 1)), vidur.decode_s(b, c),
              vidur.decode_s(b, c, kv_save=False)) for label, b, c in DECODES]  # fmt: skip
    return rows


def main() -> None:
    ours = LLAMA3_8B_A100.profile()
    print(f"Llama-3-8B on an A100: {ours.name} against Vidur's profile (ms per step)")
    print(f"{'step':<30}{'ours':>9}{'Vidur':>9}{'ratio':>7}{'Vidur, no KV save':>19}{'ratio':>7}")
    for label, mine, theirs, unsaved in comparison(ours):
        print(f"{label:<30}{mine * 1e3:>9.2f}{theirs * 1e3:>9.2f}{mine / theirs:>7.2f}"
              f"{unsaved * 1e3:>19.2f}{mine / unsaved:>7.2f}")  # fmt: skip
    print("Vidur's figures are GPU kernel time without LM head, embedding or CPU overhead;")
    print("ours include the profile's step and sequence overheads.")


if __name__ == "__main__":
    main()
