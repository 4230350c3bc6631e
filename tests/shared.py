"""Paths to the project's shared material, which lies beside the repository."""

from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
MOONCAKE_TRACE = SHARED / "traces" / "mooncake_conversation.jsonl"
