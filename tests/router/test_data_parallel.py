"""A data-parallel server's ranks as the gateway names and follows them
(router/fleet/data_parallel.py), and as its card counts them."""

from replica.api.card import vllm_card
from replica.api.stats import KVEventsEndpoint
from router.fleet.data_parallel import rank_endpoint, rank_header, rank_name

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
