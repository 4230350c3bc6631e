"""A vLLM server of two data-parallel engines (vLLM's CPU build, the tiny model) behind
the gateway: routed as two replicas, one per rank, each followed on its own KV-event
socket and checked with a canary sent to it, each request pinned to its rank; split so
also by a gateway that joined it before it said it had two engines."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deploy.processes import free_port, free_ports
from replica.vllm_server import Ports, VLLMConfig, VLLMServer
from router.fleet.data_parallel import RANK_HEADER
from tests.router.test_vllm_backends import complete, gateway, matching, text
from tests.shared import VLLM_ARGS, stop_together, vllm_backend, wait_until_checked

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def two_ranks(tiny_model: Path) -> Iterator[VLLMServer]:
    """One server, two engines; rank R publishes where rank 0 does, its ports plus R."""
    events = free_ports(4)  # events on the first two, replays on the last two
    engine = VLLMConfig(str(tiny_model), (*VLLM_ARGS, "--data-parallel-size", "2"), dev_mode=True)
    server = VLLMServer(engine, "127.0.0.1", Ports(free_port(), events, events + 2))
    try:
        server.launch()  # not waited for: the test joins a gateway to it while it starts
        yield server
    finally:
        stop_together([server])


def warm(server: VLLMServer, model: Path, prompt: str, rank: int) -> None:
    """The prompt cached by one engine of the server, asked of it directly."""
    body = {"model": str(model), "prompt": prompt, "max_tokens": 1}
    headers = {RANK_HEADER: str(rank)}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text


def test_a_data_parallel_server_is_routed_as_a_replica_per_rank(two_ranks, tiny_model, tmp_path):
    backend = vllm_backend(two_ranks)
    # One gateway joins the server while it starts (one replica, down, nothing said of
    # its engines yet), another once it serves; both route it as a replica per rank.
    with gateway(tmp_path / "early.log", [backend], *matching(tiny_model)) as early:
        two_ranks.wait_ready()
        routed_per_rank(two_ranks, tiny_model, tmp_path)
        # The early one split the server once it said it has two engines, checked each
        # rank, and followed each rank's stream: a prompt each engine alone holds, warmed
        # while it followed them, goes to its engine and is predicted.
        stats = wait_until_checked(early, 2, timeout_s=120)
        ranks = [(b.replica_id, b.data_parallel_rank, b.routing_mode) for b in stats.backends]
        assert ranks == [(f"{two_ranks.url}#dp{r}", r, "precise") for r in (0, 1)]
        for rank in (0, 1):
            answer = complete(early, tiny_model, text(seed=10 + rank, words=700) + "three")
            assert answer.headers["x-prefix-router-replica"] == f"{two_ranks.url}#dp{rank}"
            assert int(answer.headers["x-prefix-router-predicted-cached-tokens"]) >= 600


def routed_per_rank(two_ranks: VLLMServer, tiny_model: Path, tmp_path: Path) -> None:
    """A gateway started once the server serves: a replica per rank from its join on."""
    backend = vllm_backend(two_ranks)
    with gateway(tmp_path / "gateway.log", [backend], *matching(tiny_model)) as url:
        stats = wait_until_checked(url, 2, timeout_s=120)
        ranks = [(b.replica_id, b.data_parallel_rank, b.routing_mode) for b in stats.backends]
        assert ranks == [(f"{two_ranks.url}#dp{r}", r, "precise") for r in (0, 1)]
        streams = [b.kv_stream.endpoint for b in stats.backends if b.kv_stream]
        port = two_ranks.ports.kv_events
        assert streams == [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"]
        # A prompt each engine alone holds: each request of one goes to its engine, and
        # finds there what its events said (routed as one replica, vLLM's own balancer
        # would pick the engine, and the index would mix the two caches).
        prompts = {rank: text(seed=10 + rank, words=700) for rank in (0, 1)}
        for rank, prompt in prompts.items():
            warm(two_ranks, tiny_model, prompt, rank)
        for rank, prompt in prompts.items():
            for question in ("one", "two"):
                answer = complete(url, tiny_model, prompt + question)
                assert answer.headers["x-prefix-router-replica"] == f"{two_ranks.url}#dp{rank}"
                cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                predicted = int(answer.headers["x-prefix-router-predicted-cached-tokens"])
                assert cached >= 600 and cached - 128 < predicted <= cached, (cached, predicted)
