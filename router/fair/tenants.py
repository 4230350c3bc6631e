"""API keys, tenants and the cache salt that keeps tenants' caches apart.

A cache hit is observable in latency (a shorter time to first token), so a tenant who
could hit another tenant's cached prefix could learn what that tenant sent. Every
tenant's requests therefore carry a salt derived from the tenant's name (and any
``cache_salt`` the request names, as vLLM accepts): block identities in the router
and in the replicas are seeded by it, so two tenants never share a block.

A salt is keyed with the fleet's secret (HMAC-SHA256: ``$PREFIX_ROUTER_FLEET_SECRET``
or ``--fleet-secret-file``; ``serve`` and ``up`` make one and give it to every gateway
they start), so that no one who reaches a replica can compute another tenant's salt
and probe its cache; every gateway of a fleet needs the same secret to route a tenant's
prompt to where another gateway sent it. Without a secret the salt is an unkeyed
digest, and the gateway says so at start.

Keys come from a file (one ``KEY TENANT [admin] [weight=W] [class=batch] [budget=F]``
per line, ``#`` comments) and from the environment
(``PREFIX_ROUTER_API_KEYS="KEY=TENANT,KEY=TENANT:admin:weight=2"``). A tenant's weight
and request class order the gateway's queue when the fleet is full (router/fair/fairness.py);
its budget, a fraction of each replica's GPU blocks, bounds where its new prefixes are
computed (router/fair/cache_budget.py). Only
their SHA-256 digests are kept, so a lookup's timing says nothing about a key's
bytes. No keys configured: authentication is off and every request is tenant-less.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from router.fair.fairness import PRIORITIES, priority_rank

ENV_KEYS = "PREFIX_ROUTER_API_KEYS"
ENV_FLEET_SECRET = "PREFIX_ROUTER_FLEET_SECRET"


@dataclass(frozen=True)
class Tenant:
    name: str
    admin: bool = False
    #: Its share of a saturated fleet against other tenants' (router/fair/fairness.py).
    weight: float = 1.0
    #: Its requests' class: ``interactive`` or ``batch`` (a request may ask for a
    #: less urgent class than its key's, never a more urgent one).
    priority: str = "interactive"
    #: The fraction of any replica's GPU blocks it should hold at most (``None``: no
    #: budget): see router/fair/cache_budget.py.
    cache_budget: float | None = None


class Unauthorized(Exception):
    """No valid key (401), or a valid key without the right (403)."""

    def __init__(self, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.status = status


class ApiKeys:
    def __init__(self, keys: Mapping[str, Tenant]) -> None:
        self._by_digest = {_digest(key): tenant for key, tenant in keys.items()}

    @classmethod
    def load(cls, path: str | None = None, env: Mapping[str, str] | None = None) -> ApiKeys:
        """Keys from ``path`` (if given) and from ``$PREFIX_ROUTER_API_KEYS``."""
        keys: dict[str, Tenant] = {}
        if path:
            for number, line in enumerate(Path(path).read_text().splitlines(), 1):
                fields = line.split("#", 1)[0].split()
                if fields:
                    keys[fields[0]] = _tenant(fields[1:], f"{path}:{number}")
        spec = (os.environ if env is None else env).get(ENV_KEYS, "")
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, _, rest = item.partition("=")
            keys[key] = _tenant(rest.split(":"), ENV_KEYS)
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    def tenant(self, authorization: str | None) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer KEY`` header (``None`` when keys are
        off); raises :class:`Unauthorized` for a missing or unknown key."""
        if not self.enabled:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("missing API key: send 'Authorization: Bearer KEY'")
        tenant = self._by_digest.get(_digest(key.strip()))
        if tenant is None:
            raise Unauthorized("invalid API key")
        return tenant

    def admin(self, authorization: str | None) -> None:
        """Raise :class:`Unauthorized` unless the key is an admin's (or keys are off)."""
        tenant = self.tenant(authorization)
        if tenant is not None and not tenant.admin:
            raise Unauthorized(f"tenant {tenant.name!r} may not use admin endpoints", 403)


def tenant_salt(tenant: str | None, cache_salt: str | None, secret: bytes = b"") -> str | None:
    """The salt that seeds a request's block identities: a digest of the tenant and
    its ``cache_salt``, length-prefixed so that no ``cache_salt`` one tenant chooses
    can spell another tenant's salt (and of fixed size, whatever the salt's), keyed
    with the fleet's ``secret`` (unkeyed without one: anyone can compute it)."""
    if tenant is None:
        return cache_salt
    spelled = f"{len(tenant)}:{tenant}:{cache_salt or ''}".encode()
    if secret:
        return "tenant-" + hmac.new(secret, spelled, hashlib.sha256).hexdigest()
    return "tenant-" + hashlib.sha256(spelled).hexdigest()


def fleet_secret(path: str = "", env: Mapping[str, str] | None = None) -> bytes:
    """The fleet's secret: the file's content at ``path`` (stripped), else
    ``$PREFIX_ROUTER_FLEET_SECRET``; empty if neither says."""
    if path:
        return Path(path).read_text().strip().encode()
    return (os.environ if env is None else env).get(ENV_FLEET_SECRET, "").encode()


class SaltBook:
    """Which tenant each cache salt seen belongs to, and each tenant's salts: blocks in
    the index carry the salt only (a tenant's cache budget and its footprint count
    them). Bounded: salts a tenant's own ``cache_salt`` spells are unbounded."""

    def __init__(self, max_salts: int = 65_536) -> None:
        self.max_salts = max_salts
        self._tenant: dict[str, str] = {}
        self._salts: dict[str, set[str]] = {}

    def learn(self, salt: str, tenant: str) -> None:
        if salt not in self._tenant and len(self._tenant) < self.max_salts:
            self._tenant[salt] = tenant
            self._salts.setdefault(tenant, set()).add(salt)

    def tenant_of(self, salt: str | None) -> str | None:
        return self._tenant.get(salt) if salt is not None else None

    def salts_of(self, tenant: str) -> Collection[str]:
        return self._salts.get(tenant, ())


USAGE = "KEY TENANT [admin] [weight=W] [class=interactive|batch] [budget=F, 0 < F <= 1]"


def _tenant(fields: list[str], where: str) -> Tenant:
    if not fields or not fields[0]:
        raise ValueError(f"{where}: expected {USAGE}")
    admin, weight, priority, budget = False, 1.0, PRIORITIES[0], None
    for option in fields[1:]:
        name, _, value = option.partition("=")
        try:
            if option == "admin":
                admin = True
            elif name == "weight" and float(value) > 0:
                weight = float(value)
            elif name == "class":
                priority = PRIORITIES[priority_rank(value)]
            elif name == "budget" and 0 < float(value) <= 1:
                budget = float(value)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"{where}: bad {option!r}; expected {USAGE}") from None
    return Tenant(fields[0], admin, weight, priority, budget)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
