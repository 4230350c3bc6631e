"""vLLM's router (the real ``vllm-router`` binary) in its P/D mode, in front of our
prefill and decode replicas: they speak its ``kv_transfer_params`` protocol."""

import httpx
import psutil
import pytest

from deploy.processes import running
from loadtest.vllm_router import vllm_router
from replica.api.identity import DEFAULT_MODEL
from tests.shared import replica_stats

pytestmark = pytest.mark.slow


def routers_over(worker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if "vllm_router.launch_router" in command and worker in command:
            found.append(process)
    return found


def test_it_prefills_on_one_replica_and_decodes_on_the_other(tmp_path):
    flags = ["replica", "--speedup", "20", "--num-blocks", "2048"]
    with running([*flags, "--role", "prefill"], [*flags, "--role", "decode"]) as (p, d):
        with vllm_router([p], [d], log=tmp_path / "router.log") as router:
            for stream in (False, True):
                body = {
                    "model": DEFAULT_MODEL,
                    "messages": [{"role": "user", "content": f"Read {stream}: " + "words " * 300}],
                    "max_tokens": 4,
                    "ignore_eos": True,
                    "stream": stream,
                }
                answer = httpx.post(router + "/v1/chat/completions", json=body, timeout=60)
                assert answer.status_code == 200, answer.text
            assert "data: [DONE]" in answer.text
            prefill, decode = replica_stats(p), replica_stats(d)
            assert prefill.requests == 2 and decode.requests == 2
            assert decode.transfers.pulls == 2 and decode.transfers.pull_fallbacks == 0
            assert prefill.transfers.lent_blocks >= decode.transfers.pulled_tokens // 16
            assert decode.cache.query_tokens == 0  # the prefill replica counted the prompts
        assert routers_over(p) == []
