"""``prefix-router bench``: routing policies compared under real HTTP load.

For each policy in turn: reset every replica's cache and statistics, switch the
gateway to the policy, play the same seeded workload with Locust (headless, in its
own process) until every session is done, then collect Locust's figures, the
client's, the replicas' and the gateway's into one row (DESIGN.md section 7). Beside
each live row stands the offline replay's prediction for the same workload and fleet.

Targets: the embedded deployment (default: ``prefix-router serve`` in a subprocess,
stopped at the end), the gateways that ``prefix-router up`` put on a ``ray start``
cluster (``--address auto``), or any gateway or OpenAI-compatible server
(``--gateway URL``). Given several gateways (``--gateways N`` embedded, or several
URLs), each request goes to one of them at random, and every gateway is switched
and counted. The label ``sglang_router`` among the policies of our gateway is a row routed by
SGLang's router (the real binary), started in front of the same replicas for that row
only (against another target, it is only a label).
"""

from loadtest.bench.comparison import compare
from loadtest.bench.config import BENCH_HOST_BLOCKS, BENCH_REPLICA_BLOCKS, BenchConfig
from loadtest.bench.prediction import REPLAY_TOLERANCE
from loadtest.bench.sizing import Sizing, check_size_load, sized
from loadtest.bench.targets import cluster_gateways, embedded

__all__ = [
    "BENCH_HOST_BLOCKS",
    "BENCH_REPLICA_BLOCKS",
    "REPLAY_TOLERANCE",
    "BenchConfig",
    "Sizing",
    "check_size_load",
    "cluster_gateways",
    "compare",
    "embedded",
    "sized",
]
