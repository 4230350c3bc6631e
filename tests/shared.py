"""Data the tests read: the head of the Mooncake trace, shipped with the tests."""

from pathlib import Path

#: The first 400 requests of ../shared/traces/mooncake_conversation.jsonl (see data/README.md).
MOONCAKE_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_head.jsonl"
