"""Bad input gets a clear 4xx naming the problem, never a 5xx or a hang; a fuzzer
agrees; slow and vanishing clients neither stall others nor leak load counts."""

import json
import shlex
import socket
import subprocess
import sys
import time

import httpx
import pytest

from deploy.processes import running

pytestmark = pytest.mark.slow

PROMPT = "Hello, fleet. " * 10


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("k-user user\n")
    with running(["replica", "--speedup", "50"]) as (replica,):
        limits = ["--max-prompt-tokens", "2000", "--max-request-bytes", "200000"]
        command = ["gateway", f"--backend={replica}", f"--api-keys-file={keys}", *limits]
        with running(command) as (url,):
            yield url


def post(url: str, path: str, content: bytes | str, key: str | None = "k-user") -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=30)


WIZARD = {"role": "wizard", "content": "hi"}  # a role no chat template knows
CASES = [  # (path, body, status, words the message must contain, param)
    ("/v1/completions", "{not json", 400, "invalid JSON", None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "ten"}, 400, "integer", "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1}, 400, "greater", "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**9}, 400, "less", "max_tokens"),
    ("/v1/completions", {"prompt": [1, -5]}, 400, "token ids", "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "model": "gpt-9"}, 404, "gpt-9", "model"),
    ("/v1/completions", {"prompt": "x" * 10_000}, 413, "2000", "prompt"),
    ("/v1/completions", {"prompt": [PROMPT, "x" * 10_000]}, 413, "prompt 1 of the batch", "prompt"),
    ("/v1/completions", {"prompt": "x" * 300_000}, 413, "200000 bytes", None),
    ("/v1/chat/completions", {"messages": []}, 400, "at least 1", "messages"),
    ("/v1/chat/completions", {"messages": [WIZARD]}, 400, "role", "messages.0.role"),
    ("/v1/chat/completions", [1, 2], 400, "", None),
]


@pytest.mark.parametrize(("path", "body", "status", "words", "param"), CASES)
def test_malformed_requests_get_a_4xx_that_names_the_problem(
    gateway, path, body, status, words, param
):
    content = body if isinstance(body, str) else json.dumps(body)
    response = post(gateway, path, content)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param


def test_a_fuzzer_finds_no_server_error(gateway, tmp_path):
    """schemathesis against the gateway's own OpenAPI schema: 500+ generated cases."""
    report = tmp_path / "report.json"
    fuzz = shlex.split(
        "--checks not_a_server_error --max-examples 60 --seed 0 --request-timeout 30"
    )
    user = ["--header", "Authorization: Bearer k-user"]
    out = ["--workers", "1", "--report", "json", "--report-json-path", str(report), "--no-color"]
    schemathesis = [sys.executable, "-m", "schemathesis.cli", "run"]
    command = [*schemathesis, f"{gateway}/openapi.json", *fuzz, *user, *out]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    figures = json.loads(report.read_text())
    assert done.returncode == 0, done.stdout[-3000:]
    assert figures["test_cases"]["generated"] >= 500
    assert figures["test_cases"]["with_failures"] == 0 and figures["errors"] == []
    print(f"fuzz: {figures['test_cases']['generated']} cases, no server error")
    assert_no_load_left(gateway)


def assert_no_load_left(url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        backends = httpx.get(f"{url}/stats").json()["backends"]
        if all(b["outstanding_requests"] == 0 for b in backends):
            break
        assert time.monotonic() < deadline, backends
        time.sleep(0.1)
    assert all(b["outstanding_prefill_tokens"] == 0 for b in backends)


def test_slow_and_vanishing_clients_stall_nobody_and_leak_no_load(gateway):
    host, port = gateway.removeprefix("http://").split(":")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 8}).encode()
    # A client that sends its headers, then half its body, then nothing.
    slow = socket.create_connection((host, int(port)))
    slow.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer k-user\r\nContent-Length: %d\r\n\r\n"
        % len(body)
        + body[: len(body) // 2]
    )
    try:
        # Meanwhile everyone else is served, streams that vanish mid-answer included.
        for _ in range(5):
            assert post(gateway, "/v1/completions", body).status_code == 200
        stream = json.dumps({"prompt": PROMPT, "max_tokens": 500, "stream": True})
        headers = {"authorization": "Bearer k-user", "content-type": "application/json"}
        for _ in range(5):
            with httpx.stream(
                "POST", f"{gateway}/v1/completions", content=stream, headers=headers
            ) as r:
                next(r.iter_lines())  # one event, then hang up
        assert post(gateway, "/v1/completions", body).status_code == 200
    finally:
        slow.close()
    assert_no_load_left(gateway)
