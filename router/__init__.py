"""The gateway: OpenAI-compatible HTTP in front of a fleet, routing each prompt to the
replica most likely to hold its prefix, balanced against load.

Rooms, top to bottom (each imports only from those below it; ``make lint`` checks):

- ``http/``: the HTTP surface: the app and its endpoints, ``/metrics``, the dashboard;
- ``gateway``: one gateway's parts, and the request path composed from its stages;
- ``path/``: the request path's stages, one module each, in the order a request
  walks them (``router/path/__init__.py``);
- ``stats``, ``config``: the gateway's typed ``/stats`` and its configuration;
- ``fair/``: fair sharing: tenants and keys, the fair queue, slots, cache budgets;
- ``fleet/``: the backends, their join checks, load, models, the HTTP client, scaling;
- ``policies/``: the routing policies, chosen by name;
- ``index/``: what the router knows of the replicas' caches: the prefix index, its
  packed tables, the keys of events and prompts, the KV event streams;
- ``core``: the types every room shares (a replica's state, a routed request, the clock).
"""
