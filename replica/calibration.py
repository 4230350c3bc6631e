"""Step costs fitted to what a live engine measured, by least squares.

Every measurement is linear in the terms of :class:`~replica.api.cost_model.StepCosts` once
the memory floor is left out (an engine compute-bound at every batch, as a CPU is):

- the time to first token of a request alone on the engine is a per-request overhead
  (HTTP, tokenizing, scheduling: outside any step) plus its prefill steps, each a step's
  and a sequence's overhead, its new tokens and their attention pairs;
- the gap between two tokens of ``b`` sequences decoding together is one decode step:
  a step's overhead, ``b`` sequences and tokens, and the attention over their contexts.

The sequence overhead and the LM head are both paid once per sequence in a step, so
they cannot be told apart: the fit puts both in ``seq_s``. The fit weighs each sample
by its own time (it minimises relative errors: a 5 ms step matters as much as a 500 ms
prefill) and keeps every term non-negative.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from replica.api.cost_model import StepCosts, attention_pairs

#: The fitted terms, in the order of a sample's features.
TERMS = ("request_s", "step_s", "seq_s", "token_s", "attention_pair_s")


@dataclass(frozen=True)
class PrefillSample:
    """A request alone on the engine: ``cached`` of its ``prompt`` tokens were in the
    prefix cache, the rest prefilled in chunks of at most ``chunk`` tokens."""

    prompt: int
    cached: int
    chunk: int
    ttft_s: float

    def features(self) -> list[float]:
        steps = pairs = 0.0
        for start in range(self.cached, self.prompt, self.chunk):
            tokens = min(self.chunk, self.prompt - start)
            steps += 1
            pairs += attention_pairs(start, tokens)
        return [1.0, steps, steps, float(self.prompt - self.cached), pairs]

    @property
    def measured_s(self) -> float:
        return self.ttft_s


@dataclass(frozen=True)
class DecodeSample:
    """``seqs`` sequences decoding together, ``context`` tokens of KV between them."""

    seqs: int
    context: int
    itl_s: float

    def features(self) -> list[float]:
        return [0.0, 1.0, float(self.seqs), float(self.seqs), float(self.context)]

    @property
    def measured_s(self) -> float:
        return self.itl_s


Sample = PrefillSample | DecodeSample


@dataclass(frozen=True)
class Fit:
    costs: StepCosts
    request_s: float
    samples: tuple[Sample, ...]

    def terms(self) -> list[float]:
        """The fitted values, in the order of :data:`TERMS`."""
        c = self.costs
        return [self.request_s, c.step_s, c.seq_s, c.token_s, c.attention_pair_s]

    def predicted_s(self, sample: Sample) -> float:
        return float(np.dot(sample.features(), self.terms()))

    def residuals(self) -> list[float]:
        """Each sample's relative error: fitted over measured, less one."""
        return [self.predicted_s(s) / s.measured_s - 1 for s in self.samples]

    @property
    def median_residual(self) -> float:
        return float(np.median(np.abs(self.residuals())))

    @property
    def worst_residual(self) -> float:
        return float(np.max(np.abs(self.residuals())))


def fit(samples: Sequence[Sample]) -> Fit:
    """The non-negative terms that best explain ``samples``; raises ``ValueError`` when
    the samples cannot tell the terms apart (no decode samples, or one batch size)."""
    if not any(isinstance(s, PrefillSample) for s in samples):
        raise ValueError("calibration needs requests timed alone (time to first token)")
    if len({s.seqs for s in samples if isinstance(s, DecodeSample)}) < 2:
        raise ValueError("calibration needs decode steps timed at two batch sizes at least")
    features = np.array([s.features() for s in samples])
    measured = np.array([s.measured_s for s in samples])
    if np.any(measured <= 0):
        raise ValueError("every measured time must be positive")
    terms = _non_negative_least_squares(features / measured[:, None], np.ones(len(samples)))
    request_s, step_s, seq_s, token_s, pair_s = terms.tolist()
    return Fit(StepCosts(step_s, seq_s, token_s, pair_s), request_s, tuple(samples))


def _non_negative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every term at least 0: a term the unconstrained fit makes
    negative is held at 0 and the rest refitted (enough for five terms)."""
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    free = np.ones(a.shape[1], dtype=bool)
    while True:
        terms = np.zeros(a.shape[1])
        solved, *_ = np.linalg.lstsq(a[:, free] / scale[free], b, rcond=None)
        terms[free] = solved / scale[free]
        if terms.min() >= 0:
            return terms
        free[int(np.argmin(terms))] = False
