"""Where a deployment's actors live in Ray: one namespace, actors found by name."""

#: The Ray namespace of every prefix-router deployment (embedded or on a cluster).
NAMESPACE = "prefix-router"
#: Replica actors are named ``replica-0``, ``replica-1``, ...; the gateways follow them.
REPLICA_PREFIX = "replica-"
#: Gateway actors (``serve --gateways N``, ``up``) are named ``gateway-0``, ...
GATEWAY_PREFIX = "gateway-"
#: The actor that grows and shrinks the fleet (deploy/scaler.py), where it scales.
SCALER_NAME = "fleet-scaler"


def numbered(names: list[str], prefix: str) -> list[str]:
    """The actor names that are ``prefix`` and a number, in the numbers' order."""
    mine = [n for n in names if n.startswith(prefix) and n.removeprefix(prefix).isdigit()]
    return sorted(mine, key=lambda name: int(name.removeprefix(prefix)))
