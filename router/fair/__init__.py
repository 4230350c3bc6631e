"""Fair sharing of a saturated fleet: who sent a request (``tenants``: API keys, cache
salts, classes), who goes next when every replica is full (``fairness``, the fair
queue; ``admission``, the bounded wait), which replicas have a slot for whom
(``slots``), and where a tenant's new prefix may be computed (``cache_budget``).
The gateway and the replayer use the same rules."""
