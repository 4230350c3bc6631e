"""The completion endpoints answered from uvicorn's protocol (router/http/hot_path.py),
through a real ``gateway`` process: what a client sees is what ASGI answered before."""

import asyncio
import json
import socket
import threading

import httpx
import pytest

from deploy.processes import free_port, running
from deploy.serving import Server, uvicorn_config
from replica.api.identity import DEFAULT_MODEL
from router.config import GatewayConfig
from router.http.app import GatewayApp, create_app
from tests.shared import gateway_stats, in_flight, wait_for

pytestmark = pytest.mark.slow

#: Answers of exactly max_tokens (the simulated model may end one early otherwise).
BODY = {
    "model": DEFAULT_MODEL,
    "prompt": "The hot path. " * 30,
    "max_tokens": 3,
    "ignore_eos": True,
}
CHAT = {
    "model": DEFAULT_MODEL,
    "messages": [{"role": "user", "content": "Hi " * 40}],
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def fleet():
    """A slow replica (a long stream stays open) behind a gateway with a small body limit."""
    with running(["replica", "--speedup", "5"]) as (replica,):
        flags = ["gateway", f"--backend={replica}", "--max-request-bytes", "20000"]
        with running(flags) as (gateway,):
            yield gateway


def raw_exchange(gateway: str, payload: bytes, replies: int) -> list[bytes]:
    """Send ``payload`` on one connection; read until ``replies`` answers have come."""
    host, port = gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(payload)
        data = b""
        while data.count(b"HTTP/1.1 ") < replies or not _complete(data, replies):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return [b"HTTP/1.1 " + part for part in data.split(b"HTTP/1.1 ")[1:]]


def _complete(data: bytes, replies: int) -> bool:
    last = data.split(b"HTTP/1.1 ")[replies]
    head, _, body = last.partition(b"\r\n\r\n")
    length = [line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    return bool(length) and len(body) >= int(length[0].split(b":")[1])


def post(path: str, body: bytes, version: str = "1.1", extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/{version}\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def test_completions_and_chats_are_answered_with_the_routers_headers(fleet):
    with httpx.Client(base_url=fleet, timeout=30) as client:  # one kept-alive connection
        for _ in range(3):
            answer = client.post("/v1/completions", json=BODY)
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 3
            assert answer.headers["x-prefix-router-replica"]
            assert answer.headers["content-type"] == "application/json"
        assert (
            client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}).status_code == 200
        )
        with client.stream(
            "POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 4, "stream": True}
        ) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert sum('"content"' in event for event in events) >= 4


def test_refusals_keep_their_status_and_shape(fleet):
    with httpx.Client(base_url=fleet, timeout=30) as client:
        invalid = client.post("/v1/completions", content=b"{not json")
        assert invalid.status_code == 400 and "invalid JSON" in invalid.json()["error"]["message"]
        not_object = client.post("/v1/completions", content=b"[1, 2]")
        assert not_object.status_code == 400
        big = client.post("/v1/completions", json={**BODY, "prompt": "x" * 30000})
        assert big.status_code == 413 and "over the limit" in big.json()["error"]["message"]
        unknown = client.post("/v1/completions", json={**BODY, "model": "no-such-model"})
        assert unknown.status_code == 404
        # NaN is what Python's json (vLLM's reader) takes: forwarded, not refused
        nan = client.post(
            "/v1/completions", content=json.dumps(BODY)[:-1].encode() + b', "x": NaN}'
        )
        assert nan.status_code == 200, nan.text
        # other methods and paths are FastAPI's, as before
        assert client.get("/v1/completions").status_code == 405
        assert client.get("/v1/models").status_code == 200


def test_a_chunked_body_over_the_limit_is_refused(fleet):
    chunk = b"x" * 15000
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    body = b"".join(b"%x\r\n%b\r\n" % (len(chunk), chunk) for _ in range(2)) + b"0\r\n\r\n"
    (answer,) = raw_exchange(fleet, head + body, 1)
    assert answer.startswith(b"HTTP/1.1 413")


def test_pipelined_requests_are_answered_in_order_on_one_connection(fleet):
    first = json.dumps({**BODY, "max_tokens": 5}).encode()
    second = json.dumps({**BODY, "max_tokens": 1}).encode()
    answers = raw_exchange(
        fleet, post("/v1/completions", first) + post("/v1/completions", second), 2
    )
    assert [a.split(b"\r\n", 1)[0] for a in answers] == [b"HTTP/1.1 200 OK"] * 2
    tokens = [
        json.loads(a.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] for a in answers
    ]
    assert tokens == [5, 1]  # in the order sent, though the second would finish first


def test_http_1_0_is_answered_and_closed(fleet):
    (answer,) = raw_exchange(fleet, post("/v1/completions", json.dumps(BODY).encode(), "1.0"), 1)
    head = answer.partition(b"\r\n\r\n")[0].lower()
    assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in head


def test_a_client_that_leaves_mid_stream_is_settled(fleet):
    body = json.dumps({**BODY, "max_tokens": 2000, "stream": True, "ignore_eos": True}).encode()
    host, port = fleet.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(post("/v1/completions", body))
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        wait_for(lambda: in_flight(gateway_stats(fleet)) == 1, 10, "the stream in flight")
    # gone after a few tokens: the relay is stopped and its request settled
    wait_for(lambda: in_flight(gateway_stats(fleet)) == 0, 30, "the stream settled")


def test_completions_do_not_cross_asgi_and_the_rest_does():
    """Served as ``gateway`` serves it (deploy/serving.py's settings), in this process,
    with the app's ASGI entry watched."""
    asgi_paths: list[str] = []

    class Watched(GatewayApp):
        async def __call__(self, scope, receive, send):
            asgi_paths.append(scope.get("path", scope["type"]))
            await super().__call__(scope, receive, send)

    with running(["replica", "--speedup", "100"]) as (replica,):
        app = create_app(GatewayConfig(), [replica])
        app.__class__ = Watched
        port = free_port()
        server = Server(uvicorn_config(app, host="127.0.0.1", port=port))
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),))
        thread.start()
        try:
            wait_for(lambda: server.started or not thread.is_alive(), what="the gateway serving")
            url = f"http://127.0.0.1:{port}"
            for path, body in (("/v1/completions", BODY), ("/v1/chat/completions", CHAT)):
                assert httpx.post(url + path, json=body, timeout=30).status_code == 200
            assert httpx.get(url + "/health", timeout=30).status_code == 200
        finally:
            server.stop()
            thread.join(timeout=30)
            loop.close()
    assert "/health" in asgi_paths
    assert not {"/v1/completions", "/v1/chat/completions"} & set(asgi_paths)
