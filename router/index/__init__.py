"""What the router knows of the replicas' caches: block identity -> replicas
(``prefix_index``, on the packed tables of ``lean_index`` and ``_lean_index.c``), the
router's keys for the blocks an engine's KV events describe (``event_keys``) and for a
conversation's next turn (``key_cache``), the events and load followed on ZMQ
(``kv_subscriber``), and the prompt beginnings seen most (``hot_prefixes``)."""
