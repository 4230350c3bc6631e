"""The gateway's CPU by stage (benchmarks/path_profile.py): samples given to the stage
of their innermost frame that names one, waiting ones left out; and a real gateway
profiled by py-spy under load."""

import asyncio

import pytest

from benchmarks import path_profile
from benchmarks.bench_gateway import REPLICA, listeners, saturate
from benchmarks.path_profile import EVENT_LOOP, by_stage
from deploy.processes import running

ROOT = "<module> (prefix_router/__main__.py:1);Runner.run (asyncio/runners.py:118)"


def sample(*frames: str, count: int = 1) -> str:
    return ";".join([ROOT, *frames]) + f" {count}"


def test_each_sample_goes_to_its_innermost_stage_and_waits_are_left_out():
    raw = [
        # the decision inside the placement, inside the gateway's glue
        sample(
            "Gateway.handle (router/gateway.py:135)",
            "Placer.place (router/path/place.py:55)",
            "CacheAware.choose (router/policies/cache_aware.py:140)",
            count=5,
        ),
        # a socket write (C) under the upstream call: the call's
        sample(
            "Dispatcher.send (router/path/dispatch.py:63)",
            "Client.post (router/fleet/http_client.py:240)",
            "write (libc.so.6)",
            count=3,
        ),
        # the answer's write: the relay's
        sample(
            "HotPathProtocol._answer (router/http/hot_path.py:120)",
            "Dispatcher._whole (router/path/dispatch.py:150)",
            count=2,
        ),
        sample("read (libc.so.6)", count=4),  # the event loop's own reads
        sample("poll (libc.so.6)", count=50),  # idle: no CPU
        sample("Thread.run (threading.py:1)", "pthread_cond_timedwait (libc.so.6)", count=9),
        sample("Thread.run (threading.py:1)", "KVStreams._run (router/index/kv_subscriber.py:9)"),
    ]
    profile = by_stage(raw)
    assert profile.total == 5 + 3 + 2 + 4 + 1
    assert profile.samples == {
        "the decision": 5,
        "the upstream call": 3,
        "relaying the answer": 2,
        EVENT_LOOP: 4,
        "background (KV events, load reports, health)": 1,
    }
    assert "the decision" in profile.table() and "33.3%" in profile.table()


@pytest.mark.slow
def test_a_real_gateway_under_load_is_profiled_by_stage(tmp_path):
    with running(REPLICA, REPLICA) as replicas:
        backends = [f"--backend={url}" for url in replicas]
        with running(["gateway", *backends]) as (gateway,):
            pids = [process.pid for process in listeners(gateway)]
            spies = path_profile.record(pids, 2.0, tmp_path / "py-spy")
            result = asyncio.run(saturate([gateway], 16, 3.0))
            profile = path_profile.collected(spies, tmp_path / "py-spy", pids)
    assert result.done > 100 and not result.failed
    assert profile.total > 50
    for stage in ("the decision", "the upstream call", "keys", "reading and parsing the body"):
        assert profile.samples.get(stage, 0) > 0, profile.table()
