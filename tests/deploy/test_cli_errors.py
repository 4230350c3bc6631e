"""Bad input on the command line: one line naming the problem and its fix, exit status
2, no traceback, and at once (no command waits for what is not there)."""

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.processes import free_port
from tests.shared import prefix_router


def refused(*args: str) -> str:
    """The one error line a refused command printed."""
    done = prefix_router(*args)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if "error:" in x]
    return line


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port something else listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


BACKEND = "http://127.0.0.1:9"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["gateway", "--backend", "127.0.0.1:8001"],
            "its URL needs http:// or https:// (say http://127.0.0.1:8001)",
        ),
        (["gateway", "--backend", "http://127.0.0.1:x"], "its port is not a number"),
        (
            ["gateway", "--backend", BACKEND, "--max-retries", "-1"],
            "--max-retries must be at least 0, got -1",
        ),
        (
            ["gateway", "--backend", BACKEND, "--max-outstanding-per-replica", "0"],
            "--max-outstanding-per-replica must be at least 1, got 0",
        ),
        (
            ["gateway", "--backend", BACKEND, "--upstream-timeout-s", "0"],
            "--upstream-timeout-s must be positive",
        ),
    ],
)
def test_a_gateway_refuses_what_would_fail_every_request(args, says):
    assert says in refused(*args)


def test_a_chat_template_path_that_does_not_exist_is_not_taken_for_a_template(tiny_model):
    template = ("--chat-template", "templates/mistyped.jinja")
    line = refused("gateway", "--backend", BACKEND, "--tokenizer", str(tiny_model), *template)
    assert "'templates/mistyped.jinja' looks like a file's path, but there is no such file" in line


@pytest.mark.parametrize("command", ["gateway --backend http://127.0.0.1:9", "replica"])
def test_a_busy_port_is_named(command, busy_port):
    line = refused(*command.split(), "--port", str(busy_port))
    assert f"port {busy_port} on 127.0.0.1 is in use" in line and "--port" in line


@pytest.mark.parametrize("command", ["status", "down", "up --replicas 1"])
def test_no_ray_cluster_at_the_address_is_said_at_once(command):
    address = f"127.0.0.1:{free_port()}"  # nothing listens: Ray alone would retry a minute
    line = refused(*command.split(), "--address", address)
    assert f"no Ray cluster at {address}" in line and "ray start --head" in line


def test_an_unreachable_bench_target_is_not_called_a_foreign_one():
    url = f"http://127.0.0.1:{free_port()}"
    line = refused("bench", "--gateway", url, "--no-progress")
    assert f"cannot reach {url}" in line and "not a prefix-router gateway" not in line


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"timestamp": 0, "input_length": 10}', "missing output_length, hash_ids"),
        ("not json", "not JSON"),
        (
            '{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": [1]}',
            "must be numbers",
        ),
    ],
)
def test_a_bad_trace_line_is_named_by_file_and_line(tmp_path: Path, text, says):
    trace = tmp_path / "trace.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    trace.write_text(f"{good}\n{text}\n")
    line = refused("replay", "--workload", f"trace:{trace}", "--no-progress")
    assert f"{trace}, line 2: " in line and says in line


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--size-load", "1.5"], "--size-load 1.5: a share of the time, in (0, 1)"),
        (
            ["--size-load", "0.4", "--workload", "trace:mooncake.jsonl"],
            "--size-load sizes the chat workload's session rate; trace:mooncake.jsonl sets",
        ),
    ],
)
def test_a_bench_load_that_cannot_be_sized_is_refused_before_anything_starts(args, says):
    assert says in refused("bench", "--gateway", BACKEND, "--no-progress", *args)
