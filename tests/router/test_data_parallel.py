"""A data-parallel server's ranks as the gateway names and follows them
(router/fleet/data_parallel.py), and as its card counts them; our simulated replica's
``--data-parallel-size`` behind a real gateway (vLLM's own: test_vllm_data_parallel.py)."""

import httpx
import numpy as np
import pytest

from deploy.processes import running
from replica.api import stats as stats_codec
from replica.api.card import RANK_HEADER, vllm_card
from replica.api.stats import KVEventsEndpoint, ReplicaStats
from router.fleet.data_parallel import rank_endpoint, rank_header, rank_name
from tests.shared import wait_until_checked

CACHE_INFO = 'vllm:cache_config_info{block_size="32",engine="%d",num_gpu_blocks="244"} 1.0\n'


def test_rank_r_publishes_where_rank_0_does_its_ports_plus_r_as_vllm_offsets_them():
    zero = KVEventsEndpoint("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5567", "kv", "")
    one = rank_endpoint(zero, 1)
    assert (one.endpoint, one.replay_endpoint, one.topic) == (
        "tcp://10.0.0.5:5558",
        "tcp://10.0.0.5:5568",
        "kv",
    )
    assert rank_endpoint(zero, 0) is zero
    ipc = rank_endpoint(KVEventsEndpoint("ipc:///tmp/kv", "tcp://*:0", "kv"), 2)
    assert (ipc.endpoint, ipc.replay_endpoint) == ("ipc:///tmp/kv_dp2", "tcp://*:0")
    assert rank_name("http://h:8000", 1) == "http://h:8000#dp1"
    assert rank_header(1) == b"x-data-parallel-rank: 1\r\n" and rank_header(None) == b""


def test_a_vllm_servers_card_counts_the_engines_its_metrics_label():
    models = [{"id": "tiny", "root": "/models/tiny"}]
    two = vllm_card("http://h:8000", CACHE_INFO % 0 + CACHE_INFO % 1, models)
    one = vllm_card("http://h:8000", CACHE_INFO % 0, models)
    assert two is not None and two.data_parallel_size == 2 and two.num_blocks == 244
    assert one is not None and one.data_parallel_size == 1


def rank_stats(url: str, rank: int) -> ReplicaStats:
    answer = httpx.get(f"{url}/stats", headers={RANK_HEADER: str(rank)})
    return stats_codec.decode(ReplicaStats, answer.content)


def words(seed: int, count: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(f"w{n}" for n in rng.integers(0, 10_000, count))


@pytest.mark.slow
def test_our_replica_of_two_engines_is_routed_as_a_replica_per_rank():
    """Two engines behind one simulated replica, as vLLM runs them: the gateway reads
    two ranks off its card, follows each on its own sockets (rank 0's ports plus 1),
    checks each with a canary pinned to it, and sends each prompt to the engine that
    holds it, predicting what that engine finds."""
    with running(["replica", "--data-parallel-size", "2"]) as (replica,):
        zero, one = rank_stats(replica, 0), rank_stats(replica, 1)
        assert zero.kv_events is not None and one.kv_events == zero.kv_events.of_rank(1)
        bad = httpx.post(
            f"{replica}/v1/completions", json={"prompt": "hi"}, headers={RANK_HEADER: "2"}
        )
        assert bad.status_code == 400 and "its ranks are 0 to 1" in bad.text
        with running(["gateway", f"--backend={replica}"]) as (gateway,):
            stats = wait_until_checked(gateway, 2)
            ranks = [(b.replica_id, b.data_parallel_rank, b.routing_mode) for b in stats.backends]
            assert ranks == [(f"{replica}#dp{r}", r, "precise") for r in (0, 1)]
            prompts = {rank: words(seed=rank, count=600) for rank in (0, 1)}
            for rank, prompt in prompts.items():  # each held by one engine alone
                body = {"prompt": prompt, "max_tokens": 1}
                warmed = httpx.post(
                    f"{replica}/v1/completions", json=body, headers={RANK_HEADER: str(rank)}
                )
                assert warmed.status_code == 200
            for rank, prompt in prompts.items():
                body = {"prompt": prompt + " and a question", "max_tokens": 1}
                answer = httpx.post(f"{gateway}/v1/completions", json=body, timeout=30)
                assert answer.headers["x-prefix-router-replica"] == f"{replica}#dp{rank}"
                cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                predicted = int(answer.headers["x-prefix-router-predicted-cached-tokens"])
                assert cached >= 500 and cached - 64 < predicted <= cached, (cached, predicted)
        # each engine answered its own: the warm-up, the canary, the routed request
        assert all(rank_stats(replica, r).requests >= 3 for r in (0, 1))
        assert httpx.post(f"{replica}/reset").status_code == 200  # every engine emptied
        assert [rank_stats(replica, r).cache.cached_blocks for r in (0, 1)] == [0, 0]
