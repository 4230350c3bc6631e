"""Stage 2 of the request path: resolve who sent a request and how it is routed.

From the envelope and its tenant (whose API key the gateway checked first): the
cache salt that seeds its block identities (in the gateway and,
through the ``cache_salt`` field forwarded, in the replica), its class and weight,
the model or adapter it names (404 if no replica serves it), the client's session key,
and the prompt's keys at every ``stride``-th block boundary. Out comes a
:class:`Ticket`: the :class:`~router.core.RoutingRequest` the policy sees, with the
envelope and the body to forward (with the fields the gateway sets). A prompt the gateway cannot
read is routed by load alone.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replica.api import openai as api
from replica.api.identity import affinity_key, identity_seed
from router.config import GatewayConfig
from router.core import RoutingRequest
from router.fair.fairness import PRIORITY_HEADER, priority_rank
from router.fair.tenants import SaltBook, Tenant, tenant_salt
from router.fleet.models import ModelRoutes, ServedName
from router.index.hot_prefixes import HotPrefixes
from router.index.key_cache import PrefixKeyCache
from router.path.accounting import Accounting
from router.path.envelope import Envelope


@dataclass(frozen=True)
class Ticket:
    """A request resolved: what the policy sees, and what the later stages forward."""

    envelope: Envelope
    request: RoutingRequest
    #: The body forwarded: the client's, with the fields the gateway sets (the
    #: tenant's salt; a streamed answer's usage, which tells it the cached tokens).
    body: bytes = field(default=b"", repr=False)


class Resolver:
    """Resolves envelopes for one gateway, from its models and key cache."""

    def __init__(
        self,
        config: GatewayConfig,
        models: ModelRoutes,
        prefix_keys: PrefixKeyCache,
        hot_prefixes: HotPrefixes,
        salts: SaltBook,
        accounting: Accounting,
        secret: bytes = b"",
    ) -> None:
        self.config, self.models, self.secret = config, models, secret
        self.prefix_keys, self.hot_prefixes = prefix_keys, hot_prefixes
        self.salts, self.accounting = salts, accounting

    def resolve(self, envelope: Envelope, tenant: Tenant | None) -> Ticket:
        """The envelope's ticket, for ``tenant`` (whose key the gateway checked before
        reading the body); raises ``api.Rejected`` (404, an unknown model; 400, an
        unknown class)."""
        name = tenant.name if tenant else None
        salt = tenant_salt(name, envelope.cache_salt, self.secret)
        fields = {"cache_salt": salt} if salt != envelope.cache_salt else {}
        served = self.served(envelope.body.get("model"))
        if envelope.prompt is None:
            self.accounting.unread_prompts += 1
            request = RoutingRequest(
                route_id(), 0, tenant=name, model=served.model, adapter=served.adapter
            )
        else:
            request = self.keyed(envelope.prompt, salt, name, served)
            request.session = session_key(envelope, self.config.session_key)
            self.accounting.session_requests += request.session is not None
        classify(request, envelope, tenant)
        ask_for_usage = envelope.stream and not envelope.include_usage
        return Ticket(envelope, request, rewritten(envelope.raw, ask_for_usage, fields))

    def served(self, model: object) -> ServedName:
        """What a request's ``model`` field names; 404, as vLLM answers, if no replica
        serves it."""
        name = model if isinstance(model, str) else None
        served = self.models.resolve(name)
        if served is None:
            known = ", ".join(name for name, _ in self.models.names())
            raise api.Rejected(f"the model {name!r} does not exist (served: {known})", 404, "model")
        return served

    def keyed(
        self,
        prompt: np.ndarray,
        cache_salt: str | None,
        tenant: str | None = None,
        served: ServedName | None = None,
    ) -> RoutingRequest:
        """Hash the prompt as a replica will: seeded by model (or adapter) and salt."""
        served = served or ServedName(self.config.model)
        seed = identity_seed(served.name, cache_salt)  # one short hash, no cache to grow
        if tenant is not None and cache_salt is not None:
            self.salts.learn(cache_salt, tenant)
        routing = self.config.routing
        hashes = self.prefix_keys.keys(prompt, seed)
        self.hot_prefixes.record(hashes, prompt, served.model)  # for the dashboard: a dict update
        affinity = affinity_key(prompt, routing.block_size, routing.index.stride, seed)
        return RoutingRequest(
            route_id(),
            len(prompt),
            hashes,
            tenant=tenant,
            model=served.model,
            adapter=served.adapter,
            affinity=affinity,
        )


#: A routing decision's id: unique within the gateway, which alone keeps it (in flight,
#: in its index); never sent to a client or replica, so a count serves.
_ROUTE_IDS = itertools.count()


def route_id() -> str:
    return f"route-{next(_ROUTE_IDS)}"


def classify(request: RoutingRequest, envelope: Envelope, tenant: Tenant | None) -> None:
    """What the tenant's key says of the request: its class, weight and cache budget."""
    request.priority = priority(envelope, tenant)
    if tenant is not None:
        request.weight, request.cache_budget = tenant.weight, tenant.cache_budget


def priority(envelope: Envelope, tenant: Tenant | None) -> int:
    """The request class's rank: the ``x-priority`` header's, never more urgent than
    the key's class."""
    floor = priority_rank(tenant.priority) if tenant else 0
    asked = envelope.headers.get(PRIORITY_HEADER)
    if asked is None:
        return floor
    try:
        return max(priority_rank(asked.strip().lower()), floor)
    except ValueError as error:
        raise api.Rejected(str(error), 400, PRIORITY_HEADER) from None


def session_key(envelope: Envelope, source: str) -> str | None:
    """The client's session key, read where ``--session-key`` says (``None``: none)."""
    if not source:
        return None
    if source == "user":
        key = envelope.body.get("user")
        key = key if isinstance(key, str) else None
    else:
        key = envelope.headers.get(source)
    return key or None


def rewritten(raw: bytes, ask_for_usage: bool, fields: dict[str, Any] | None) -> bytes:
    """The body with ``fields`` set, and a streamed answer's usage asked for (it tells
    the gateway the cached tokens); one rewrite, only when something must change.

    The fields are appended to the object, not merged into a parsed copy: of a JSON
    object's duplicate keys the last wins (Python's ``json``, with which FastAPI, vLLM
    and the replica read bodies), and a 100k-token conversation's 400 KB are copied
    once instead of parsed and printed again (0.05 ms against 2.8).
    """
    fields = dict(fields or {})
    if ask_for_usage:
        fields["stream_options"] = {"include_usage": True}
    if not fields:
        return raw
    head = raw.rstrip()[:-1].rstrip()  # an object (envelope.parse_body checked): less its "}"
    separator = b"" if head.endswith(b"{") else b","
    return head + separator + json.dumps(fields)[1:-1].encode() + b"}"
