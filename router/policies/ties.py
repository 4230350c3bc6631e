"""Ties broken at random, as numpy breaks them, in a fraction of its time.

``Generator.integers(n)`` costs about a microsecond in a quiet process and, measured
in a busy gateway, a twentieth of its CPU per request: numpy converts its bounds to
arrays and takes the bit generator's lock on every call. :class:`Ties` draws the same
numbers from the same generator (numpy's method, Lemire's, on the 32-bit halves of the
generator's 64-bit outputs, the spare half kept for the next draw), so routing, and
every replay's figures, stay what they were, bit for bit
(``tests/router/test_ties.py`` draws both side by side). A policy keeps its own
(policies that share a generator, a gateway's one per model, then each keep a spare
half: their picks are as random, if not numpy's to the bit).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

_MASK32 = 0xFFFFFFFF


class Ties:
    """Uniform picks below ``n`` from one generator, as ``integers(n)`` makes them."""

    def __init__(self, rng: np.random.Generator) -> None:
        self._bits = rng.bit_generator
        self._raw = rng.bit_generator.random_raw
        self._half: int | None = None  # numpy's spare 32 bits (``has_uint32``)

    @property
    def state(self) -> tuple[Mapping[str, Any], int | None]:
        """The generator's state and the spare half: set it back to draw the same again
        (as ``bit_generator.state`` is for numpy's own draws)."""
        return self._bits.state, self._half

    @state.setter
    def state(self, state: tuple[Mapping[str, Any], int | None]) -> None:
        self._bits.state, self._half = state

    def below(self, n: int) -> int:
        """What ``rng.integers(n)`` would return, for 1 <= n <= 2**32."""
        if not 0 < n <= 1 << 32:
            raise ValueError(f"ties among {n}: between 1 and 2**32")
        product = self._next32() * n
        if product & _MASK32 < n:  # the rare draw that would bias: rejected as numpy does
            threshold = (-n & _MASK32) % n
            while product & _MASK32 < threshold:
                product = self._next32() * n
        return product >> 32

    def _next32(self) -> int:
        half = self._half
        if half is not None:
            self._half = None
            return half
        word = self._raw()
        self._half = word >> 32
        return word & _MASK32


class NumpyTies(Ties):
    """numpy's own ``integers``, for a policy that also draws with numpy's other methods
    (``power_of_two``'s pairs): numpy then keeps the one spare half, as before."""

    def __init__(self, rng: np.random.Generator) -> None:
        super().__init__(rng)
        self._rng = rng

    def below(self, n: int) -> int:
        return int(self._rng.integers(n))
