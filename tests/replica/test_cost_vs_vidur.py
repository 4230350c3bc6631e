"""The built-in profiles against Vidur's published kernel times (benchmarks/data/vidur)."""

from dataclasses import replace

import pytest

from benchmarks.bench_vidur import DECODES, PREFILLS, comparison, vidur_profiles

#: Each step's layers within this of Vidur's kernel time, its KV write left out (see the
#: benchmark).
TOLERANCE = 0.10
GPUS = vidur_profiles()


def off_rows(roofline, vidur) -> list[str]:
    return [row.label for row in comparison(roofline, vidur) if abs(row.ratio - 1) > TOLERANCE]


@pytest.mark.parametrize("gpu", GPUS)
def test_every_prefill_and_decode_step_is_within_ten_percent_of_vidurs_profile(gpu):
    roofline, vidur = GPUS[gpu]
    assert len(comparison(roofline, vidur)) == len(PREFILLS) + len(DECODES)
    assert off_rows(roofline, vidur) == []


@pytest.mark.parametrize("gpu", GPUS)
def test_the_comparison_sees_slow_gemms_slow_attention_and_a_slow_weight_read(gpu):
    roofline, vidur = GPUS[gpu]
    gemms = off_rows(replace(roofline, compute_efficiency=0.4), vidur)
    assert gemms and all(label.startswith("prefill") for label in gemms)
    # Attention dominates only the long prompts.
    attention = off_rows(
        replace(roofline, attention_efficiency=roofline.attention_efficiency / 2), vidur
    )
    assert "prefill 32k" in attention and "prefill 512" not in attention
    weights = off_rows(replace(roofline, memory_efficiency=roofline.memory_efficiency / 2), vidur)
    assert "decode batch 1, 1k context" in weights and "prefill 8k" not in weights


def test_the_lm_head_runs_once_per_sequence_in_prefill():
    roofline, _ = GPUS[next(iter(GPUS))]
    whole, layers = roofline.profile(), roofline.layers_only().profile()
    head = whole.prefill_time(0, 8192) - layers.prefill_time(0, 8192)
    assert head == pytest.approx(roofline.step_overhead_s + whole.costs.lm_head_s)
    assert whole.costs.lm_head_s < 0.01 * whole.prefill_time(0, 8192)
