"""Where a deployment's actors live in Ray: one namespace, actors found by name."""

#: The Ray namespace of every prefix-router deployment (embedded or on a cluster).
NAMESPACE = "prefix-router"
#: Replica actors are named ``replica-0``, ``replica-1``, ...; the gateway follows them.
REPLICA_PREFIX = "replica-"
#: The gateway actor of a cluster deployment (``prefix-router up``).
GATEWAY_NAME = "gateway"
