"""The request path: one module per stage (see ``router/gateway.py``, which composes
them)."""
