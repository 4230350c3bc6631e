"""The fit of step costs to timed samples (replica/calibration.py), and profile files."""

from dataclasses import replace

import numpy as np
import pytest

from replica.api.config import ReplicaConfig
from replica.api.cost_model import PROFILES, StepCosts, get_profile
from replica.calibration import DecodeSample, PrefillSample, fit
from replica.engine import EngineConfig

#: A CPU-like engine: compute-bound at every batch, no memory floor.
KNOWN = StepCosts(step_s=7e-3, seq_s=0.2e-3, token_s=40e-6, attention_pair_s=70e-9)
PROFILE = replace(PROFILES["llama3-8b-h100"], name="known", costs=KNOWN, kv_tokens=8192)
REQUEST_S = 5e-3
CHUNK = 2048


def timed_alone(prompt: int, cached: int) -> PrefillSample:
    """A request's time to first token as the profile's engine takes it, chunk by chunk."""
    steps = range(cached, prompt, CHUNK)
    seconds = sum(PROFILE.prefill_time(s, min(CHUNK, prompt - s)) for s in steps)
    return PrefillSample(prompt, cached, CHUNK, REQUEST_S + seconds)


def timed_decode(seqs: int, context: int) -> DecodeSample:
    (step,) = PROFILE.decode_step_times(seqs, seqs * context, 1)
    return DecodeSample(seqs, seqs * context, step)


def sweep() -> list:
    prefills = [timed_alone(n, int(n * f)) for n in (128, 1024, 4096) for f in (0, 0.5, 0.9)]
    return prefills + [timed_decode(b, c) for b in (1, 4, 8) for c in (256, 1024)]


def test_the_fit_recovers_the_terms_of_the_engine_that_made_the_samples():
    fitted = fit(sweep())  # chunked prefills (4096 tokens in two steps) among them
    want = [REQUEST_S, KNOWN.step_s, KNOWN.seq_s, KNOWN.token_s, KNOWN.attention_pair_s]
    assert fitted.terms() == pytest.approx(want, rel=1e-6)
    assert fitted.worst_residual < 1e-6


def test_noise_moves_the_residuals_and_no_term_goes_negative():
    rng = np.random.default_rng(0)
    noisy = [
        replace(s, ttft_s=s.ttft_s * rng.uniform(0.9, 1.1))
        if isinstance(s, PrefillSample)
        else replace(s, itl_s=s.itl_s * rng.uniform(0.9, 1.1))
        for s in sweep()
    ]
    fitted = fit(noisy)
    assert 0.01 < fitted.median_residual < fitted.worst_residual < 0.15
    assert fitted.costs.token_s == pytest.approx(KNOWN.token_s, rel=0.15)
    # An engine with no per-sequence cost: the fit holds that term at 0, never below.
    flat = [
        replace(s, itl_s=s.itl_s - s.seqs * KNOWN.seq_s)
        if isinstance(s, DecodeSample)
        else replace(s, ttft_s=s.ttft_s - KNOWN.seq_s * 5)
        for s in sweep()
    ]
    assert min(fit(flat).terms()) >= 0


def test_a_sweep_that_cannot_tell_the_terms_apart_is_refused():
    with pytest.raises(ValueError, match="two batch sizes"):
        fit([timed_alone(512, 0), timed_decode(4, 256), timed_decode(4, 1024)])
    with pytest.raises(ValueError, match="alone"):
        fit([timed_decode(1, 256), timed_decode(4, 256)])


def test_a_profile_file_round_trips_and_sizes_the_cache_as_measured(tmp_path):
    path = tmp_path / "profile.json"
    PROFILE.save(path)
    assert get_profile(str(path)) == PROFILE
    assert PROFILE.kv_blocks(32) == 256  # the measured 8,192 tokens, not the GPU's memory
    config = EngineConfig.for_replica(ReplicaConfig(profile=str(path)))
    assert config.num_blocks == 8192 // config.block_size


@pytest.mark.parametrize(
    ("text", "says"),
    [(None, "does not exist"), ("{", "not JSON"), ('{"name": 1}', "not a cost profile")],
)
def test_a_bad_profile_file_is_named(tmp_path, text, says):
    path = tmp_path / "profile.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=says):
        get_profile(str(path))
    with pytest.raises(ValueError, match="must not be negative: seq_s"):
        StepCosts(1e-3, -1e-6, 1e-6, 1e-9)
