"""A completion as it travels inside a Ray Serve application: from the ingress, through
the deployment handle (whose request router reads it), to an engine replica.

The ingress hands the body over as the client wrote it, with the headers routing
reads (the API key, the session key, the request class): the request router hashes
the prompt exactly as the gateway does, and the replica's own server answers it. It
also says ``prompt`` or ``messages``, the attributes Ray Serve LLM's
``PrefixCacheAffinityRouter`` looks for on a request, so that router can be compared
on the same application.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from router.path.envelope import parse_body, too_large

#: The headers routing reads; the rest stay with the ingress.
ROUTED_HEADERS = ("authorization", "x-session-id", "x-priority", "content-type")


@dataclass(frozen=True)
class CompletionCall:
    """One completion request: its endpoint, its body and the headers routing reads
    (names in lower case). An :class:`~router.path.envelope.Inbound` for the gateway's
    stages."""

    path: str
    raw: bytes
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return self.path.endswith("/chat/completions")

    async def body(self, limit: int) -> bytes:
        if len(self.raw) > limit:
            raise too_large(limit)
        return self.raw

    @cached_property
    def _fields(self) -> dict[str, Any]:
        try:
            return parse_body(self.raw)[1]
        except ValueError:  # api.Rejected: the replica will say why
            return {}

    @property
    def prompt(self) -> Any:
        """A completion's prompt, for Serve LLM's router (a chat has none)."""
        return self._field("prompt")

    @property
    def messages(self) -> Any:
        """A chat's messages, for Serve LLM's router (a completion has none)."""
        return self._field("messages")

    def _field(self, name: str) -> Any:
        # absent: no such attribute, as Serve LLM's router asks with ``hasattr``
        if name not in self._fields:
            raise AttributeError(name)
        return self._fields[name]

    @classmethod
    def read(cls, request: Any) -> CompletionCall | None:
        """What a deployment's request router was handed, as a call: ours as it is; Ray
        Serve LLM's parsed request (a chat's or a completion's OpenAI model, from its
        ingress) as the body its client wrote; anything else ``None``."""
        if isinstance(request, cls):
            return request
        dump = getattr(request, "model_dump_json", None)
        if dump is None or not (hasattr(request, "messages") or hasattr(request, "prompt")):
            return None
        path = "/v1/chat/completions" if hasattr(request, "messages") else "/v1/completions"
        return cls(path, dump(exclude_unset=True).encode())

    @classmethod
    def of(cls, path: str, raw: bytes, headers: Mapping[str, str]) -> CompletionCall:
        kept = {name: headers[name] for name in ROUTED_HEADERS if name in headers}
        return cls(path, raw, kept)
