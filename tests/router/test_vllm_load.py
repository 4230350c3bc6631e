"""A vLLM server's load from its /metrics text (router/fleet/vllm_load.py)."""

from router.fleet.vllm_load import vllm_load

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 99.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.75
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 2e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql",waiting_lora_adapters=""} 1.75e9
vllm:num_requests_running_total 1000.0
"""


def test_the_gauges_are_read_summed_over_engines_and_the_latest_adapters_taken():
    report = vllm_load(METRICS, num_blocks=1000, prefill_tokens=77, ts=12.5)
    assert report is not None
    assert (report.running, report.waiting) == (5, 4)  # not the "_by_reason" nor "_total"
    assert report.free_blocks == 500  # half the cache in use, over both engines
    assert report.adapters == ("sql", "chat") and report.free_adapter_slots == 2
    assert (report.prefill_tokens, report.ts) == (77, 12.5)


def test_a_server_without_lora_or_a_card_says_less_and_other_text_says_nothing():
    plain = "\n".join(line for line in METRICS.splitlines() if "lora" not in line)
    report = vllm_load(plain, num_blocks=None, prefill_tokens=0, ts=0.0)
    assert report is not None and report.adapters is None and report.free_adapter_slots is None
    assert report.free_blocks is None  # no card, no block count
    assert vllm_load("# sglang\nsglang:num_running_reqs 3\n", 100, 0, 0.0) is None


def test_one_data_parallel_engines_load_is_its_own_gauges_and_the_servers_adapters():
    report = vllm_load(METRICS, num_blocks=1000, prefill_tokens=0, ts=0.0, engine=1)
    assert report is not None
    assert (report.running, report.waiting, report.free_blocks) == (2, 0, 250)
    assert report.adapters == ("sql", "chat")  # vLLM reports adapters for the server
