"""The built-in A100 profile against Vidur's published kernel times (benchmarks/data/vidur)."""

from dataclasses import replace

from benchmarks.bench_vidur import DECODES, PREFILLS, comparison
from replica.cost_model import LLAMA3_8B_A100

#: Each step within this of Vidur's kernel time, its KV write left out (see the benchmark).
TOLERANCE = 0.10


def test_every_prefill_and_decode_step_is_within_ten_percent_of_vidurs_profile():
    rows = comparison(LLAMA3_8B_A100.profile())
    assert len(rows) == len(PREFILLS) + len(DECODES)
    for label, ours, _, vidur in rows:
        assert abs(ours / vidur - 1) <= TOLERANCE, (label, ours, vidur)


def test_the_comparison_sees_a_profile_that_is_off():
    slow = replace(LLAMA3_8B_A100, compute_efficiency=0.5).profile()
    off = [label for label, ours, _, vidur in comparison(slow) if ours / vidur - 1 > TOLERANCE]
    assert off and all(label.startswith("prefill") for label in off)
