"""The request path's HTTP client against real servers on loopback: a replica, and
small asyncio servers that misbehave on purpose."""

import asyncio
import json

import pytest

from deploy.processes import running
from router.fleet.http_client import Client, Timeouts, UpstreamError

# ignore_eos: the simulated model may end a reply early, like a real one
BODY = json.dumps({"prompt": "a short question", "max_tokens": 2, "ignore_eos": True}).encode()


@pytest.mark.slow  # it starts a replica
def test_answers_are_read_whole_or_by_line_over_one_kept_alive_connection():
    async def play(url: str) -> None:
        client = Client()
        for _ in range(20):
            answer = await client.post(url + "/v1/completions", BODY)
            assert answer.status == 200
            assert json.loads(await answer.read())["usage"]["completion_tokens"] == 2
            answer.release()
        streamed = json.dumps(
            {"prompt": "hi", "max_tokens": 3, "stream": True, "ignore_eos": True}
        ).encode()
        answer = await client.post(url + "/v1/completions", streamed)
        lines = [line async for line in answer.lines() if line]
        answer.release()
        assert lines[-1] == b"data: [DONE]" and len(lines) == 4
        assert len(client._idle[("127.0.0.1", int(url.rsplit(":", 1)[1]))]) == 1
        client.close()

    with running(["replica", "--speedup", "1000"]) as (url,):
        asyncio.run(play(url))


async def serve(handle) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def test_a_kept_alive_connection_the_server_dropped_is_retried_on_a_new_one():
    connections = 0
    hung_up = asyncio.Event()

    async def once_then_hang_up(reader, writer):
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(len(BODY))
        writer.write(OK)
        await writer.drain()
        writer.close()  # keep-alive promised, connection dropped: the next request finds it dead
        await writer.wait_closed()
        hung_up.set()

    async def play() -> None:
        server, url = await serve(once_then_hang_up)
        client = Client()
        for _ in range(3):
            answer = await client.post(url + "/v1/completions", BODY)
            assert (answer.status, await answer.read()) == (200, b"{}")
            answer.release()
            await hung_up.wait()  # the next request is sent on the connection now dead
            hung_up.clear()
        assert connections == 3
        client.close()
        server.close()

    asyncio.run(play())


def test_silence_and_hang_ups_fail_the_request():
    async def silent(reader, writer):
        await asyncio.sleep(5)

    async def half_answer(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"partial')
        await writer.drain()
        writer.close()

    async def play() -> None:
        client = Client(Timeouts(connect_s=1, read_s=0.2, total_s=5))
        server, url = await serve(silent)
        with pytest.raises(TimeoutError):
            await client.post(url + "/x", BODY)
        server.close()
        server, url = await serve(half_answer)
        answer = await client.post(url + "/x", BODY)
        with pytest.raises(UpstreamError, match=r"closed|hung up"):
            await answer.read()
        answer.release()
        server.close()
        with pytest.raises(UpstreamError, match="cannot connect"):
            await client.post(url + "/x", BODY)  # nothing listens there any more
        client.close()

    asyncio.run(play())
