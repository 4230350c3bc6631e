"""A replica's KV event log: every change to its cached blocks, in both tiers, numbered.

The GPU pool and the host tier write to one log, so a reader that applies the events
in order knows which identities each tier holds. The log keeps the last
``max_events`` (up to twice that, trimmed in halves for amortised O(1) appends); a
reader that fell further behind is told so and must start over.
"""

from __future__ import annotations

from replica.api.kv_events import EventKind, KVEvent, Medium


class EventLog:
    def __init__(self, max_events: int = 100_000) -> None:
        if max_events < 1:
            raise ValueError("max_events must be positive")
        self.max_events = max_events
        self._events: list[KVEvent] = []
        self._next_seq = 1

    def append(
        self,
        kind: EventKind,
        hashes: tuple[int, ...] = (),
        parent: int | None = None,
        depths: tuple[int, ...] = (),
        medium: Medium = "GPU",
        token_bytes: bytes = b"",
        salt: str | None = None,
        lora: str | None = None,
    ) -> None:
        event = KVEvent(
            self._next_seq, kind, hashes, parent, depths, medium, token_bytes, salt, lora
        )
        self._events.append(event)
        self._next_seq += 1
        if len(self._events) >= 2 * self.max_events:
            del self._events[: self.max_events]

    @property
    def last_seq(self) -> int:
        return self._next_seq - 1

    def drain(self) -> list[KVEvent]:
        """Every event in the log, which keeps none: for a single reader that takes the
        events as they happen (the offline replayer, whose thousand engines would
        otherwise each hold up to ``max_events`` events and their tokens)."""
        events, self._events = self._events, []
        return events

    def since(self, seq: int) -> tuple[list[KVEvent], bool]:
        """Events numbered above ``seq``, and whether any of them were lost."""
        first = self._next_seq - len(self._events)
        return self._events[max(seq + 1 - first, 0) :], seq + 1 < first
