"""A turn's request on its way through the simulated fleet."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from router.core import RoutingRequest


@dataclass(frozen=True)
class TurnRequest:
    """A turn's request from its arrival at its router (one of ``routers``) to its end:
    what the router routes by, and the prompt the engine is given."""

    session: int
    turn: int
    routing: RoutingRequest
    prompt: np.ndarray
    arrival_s: float
    router: int

    @property
    def request_id(self) -> str:
        return self.routing.request_id
