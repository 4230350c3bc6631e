"""What a replay measures as it runs: each request's record, and the evictions of
shared-prefix blocks (the apps' system prompts), which the report counts apart.

Times are as the client sees them: what a request spends outside the engine
(``request_s``, the profile's) is added to its first token and its end; the engines
are not told (admitting every request that much later would move them all alike).
"""

from __future__ import annotations

from loadtest.replay.request import TurnRequest
from loadtest.replay.result import RequestRecord
from loadtest.workloads import Session, Workload
from replica.api.identity import block_hashes, identity_seed
from replica.api.kv_events import KVEvent
from replica.engine import RequestOutput


class Metrics:
    """Every request's :class:`RequestRecord` (by request id) and the shared-prefix
    evictions so far."""

    def __init__(self, workload: Workload, model: str, block_size: int, request_s: float) -> None:
        self.records: dict[str, RequestRecord] = {}
        self.shared_prefix_evictions = 0
        self._request_s = request_s
        self._shared_hashes = shared_prefix_hashes(workload, model, block_size)

    def dispatched(
        self, request: TurnRequest, replica: int, session: Session, now: float
    ) -> RequestRecord:
        """The record of ``request``, sent to engine ``replica`` at ``now``."""
        routing = request.routing
        record = RequestRecord(
            request.request_id,
            request.session,
            request.turn,
            replica,
            request.arrival_s,
            len(request.prompt),
            shared_prefix_tokens=session.shared_prefix_tokens,
            predicted_cached_tokens=routing.predicted_cached_tokens,
            model=session.model,
            adapter=session.adapter,
            tenant=routing.tenant,
            priority=routing.priority,
            dispatched_s=now,
        )
        self.records[request.request_id] = record
        return record

    def produced(self, output: RequestOutput, now: float) -> bool:
        """A request's tokens came out of its engine at ``now``; True if they are its first."""
        record = self.records[output.request_id]
        first = record.first_token_s is None
        if first:
            record.first_token_s = now + self._request_s
        else:
            assert record.last_token_s is not None
            count = len(output.new_token_ids)
            record.token_gaps.append(((now - record.last_token_s) / count, count))
        record.last_token_s = now
        if output.finished:
            record.finish_s = now + self._request_s
            if record.path != "disaggregated":  # else its prefill leg's, set then
                record.cached_tokens = output.num_cached_tokens
            record.output_tokens = output.num_output_tokens
        return first

    def watch(self, events: list[KVEvent]) -> None:
        """Count the shared-prefix blocks that ``events`` removed."""
        if not self._shared_hashes:
            return
        for event in events:
            if event.kind == "removed":
                evicted = self._shared_hashes.intersection(event.block_hashes)
                self.shared_prefix_evictions += len(evicted)


def shared_prefix_hashes(workload: Workload, model: str, block_size: int) -> set[int]:
    """Identities of every session's shared prefix (its system prompt) blocks, each
    app's once."""
    hashes: set[int] = set()
    seen_apps: set[tuple[int, int, str | None]] = set()
    for session in workload.sessions:
        key = (session.app, session.shared_prefix_tokens, session.served_name)
        first = session.turns[0].messages
        if key in seen_apps or not session.shared_prefix_tokens or first is None:
            continue
        seen_apps.add(key)
        prompt = session.turns[0].prompt_token_ids[: session.shared_prefix_tokens]
        seed = identity_seed(session.served_name or model)
        hashes.update(block_hashes(prompt, block_size, seed))
    return hashes
