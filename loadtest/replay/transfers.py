"""KV that moves in the replay: a disaggregated request's prefill leg and the blocks
its engine holds for the decode leg, a peer's blocks lent for a pull, and each lease
shortened to its pull's end once the receiving engine has timed it. The simulation
decides when each leg goes; this room says what each engine is asked."""

from __future__ import annotations

from loadtest.replay.config import ReplayConfig
from loadtest.replay.engines import EngineSteps
from loadtest.replay.events import EventQueue
from loadtest.replay.request import TurnRequest
from loadtest.workloads import Session
from replica.api.identity import block_hashes, identity_seed
from replica.engine import EngineRequest


class Transfers:
    """What the engines lend one another, by engine index."""

    def __init__(self, engines: EngineSteps, events: EventQueue, config: ReplayConfig) -> None:
        self._engines, self._events, self._config = engines, events, config

    def prefill_leg(self, request: TurnRequest, session: Session) -> EngineRequest:
        """The prefill leg of a disaggregated request: its first token, its prompt's
        blocks held afterwards for the decode replica (vLLM's ``do_remote_decode``)."""
        return EngineRequest(
            prefill_leg_id(request),
            request.prompt,
            1,
            ignore_eos=True,
            cache_salt=session.cache_salt,
            lora=session.adapter,
            hold_s=self._config.kv_hold_s,
        )

    def held(self, request: TurnRequest, prefill: int) -> int:
        """The tokens engine ``prefill`` lends the decode leg: all it held."""
        return self._lend(prefill, prefill_leg_id(request), []) * self._config.block_size

    def peer(self, request: TurnRequest, session: Session, source: int, tokens: int) -> int:
        """The leading ``tokens`` of the prompt engine ``source`` can lend, pinned (as
        many as it still holds: fewer, if it evicted some since the router heard)."""
        seed = identity_seed(session.served_name or self._config.model, session.cache_salt)
        hashes = block_hashes(request.prompt[:tokens], self._config.block_size, seed)
        return self._lend(source, pull_id(request), hashes) * self._config.block_size

    def pulled(self, request: TurnRequest, source: int, receiver: int, disaggregated: bool) -> None:
        """The receiver has queued the request and timed its pull: the lender unpins
        the blocks when it ends."""
        ends = self._engines[receiver].pull_end_s(request.request_id) or self._events.now
        lease = prefill_leg_id(request) if disaggregated else pull_id(request)
        self._engines[source].lend(lease, [], ends)

    def _lend(self, source: int, lease: str, hashes: list[int]) -> int:
        """Blocks engine ``source`` lends under ``lease``, pinned for the hold time
        (until the pull's end, once timed: :meth:`pulled`)."""
        until = self._events.now + self._config.kv_hold_s
        return self._engines[source].lend(lease, hashes, until)


def prefill_leg_id(request: TurnRequest) -> str:
    return f"{request.request_id}/prefill"


def pull_id(request: TurnRequest) -> str:
    return f"{request.request_id}/pull"
