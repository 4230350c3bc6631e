"""``--fleet MODEL=N[:ADAPTERS]``: one engine per replica, or a clear error."""

import pytest

from deploy.fleet import fleet_engines
from replica.api.config import ReplicaConfig
from replica.vllm_server import VLLMConfig
from tests.shared import prefix_router


def test_each_entry_gives_its_replicas_its_model_and_adapters():
    engines = fleet_engines(["llama=2:sql,chat", "qwen=1"], 4, ReplicaConfig(speedup=5))
    assert [(e.model, e.lora_modules) for e in engines] == [
        ("llama", "sql,chat"),
        ("llama", "sql,chat"),
        ("qwen", ""),
    ]
    assert {e.speedup for e in engines} == {5}
    assert fleet_engines([], 3, ReplicaConfig()) == [ReplicaConfig()] * 3


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        (["llama"], "expected MODEL=N"),
        (["llama=0"], "N at least 1"),
        (["llama=2:llama"], "an adapter may not be named as its model"),
        (["llama=1:sql", "qwen=1:sql"], "every model and adapter needs a name of its own"),
    ],
)
def test_a_bad_entry_is_refused_naming_it(entries, says):
    with pytest.raises(ValueError, match=says):
        fleet_engines(entries, 1, ReplicaConfig())


def test_vllm_adapters_need_their_weights():
    with pytest.raises(ValueError, match="--enable-lora --lora-modules NAME=PATH"):
        fleet_engines(["m=1:sql"], 1, VLLMConfig("m"))


@pytest.mark.exclusive  # a `serve` process, which the bench's tests look for
def test_serve_refuses_a_bad_fleet_before_starting_anything():
    done = prefix_router("serve", "--fleet", "llama=two")
    assert done.returncode == 2 and "--fleet 'llama=two': expected MODEL=N" in done.stderr


@pytest.mark.exclusive  # a `serve` process, which the bench's tests look for
@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ("--prefill 1 --decode 3", "--decode 3 must lie within --min-replicas 1"),
        ("--fleet llama=2", "not --fleet"),
        ("--replicas 5", "--replicas 5 must lie within"),
    ],
)
def test_serve_refuses_bounds_a_pool_starts_outside(flags, says):
    done = prefix_router("serve", "--min-replicas", "1", "--max-replicas", "2", *flags.split())
    assert done.returncode == 2 and says in done.stderr, done.stderr


def test_a_disaggregated_fleet_is_its_prefill_replicas_then_its_decode_ones():
    engines = fleet_engines([], 4, ReplicaConfig(speedup=5), prefill=1, decode=2)
    assert [e.role for e in engines] == ["prefill", "decode", "decode"]
    assert {e.speedup for e in engines} == {5}
    with pytest.raises(ValueError, match="KV connector"):
        fleet_engines([], 1, VLLMConfig("m"), prefill=1, decode=1)
    connected = VLLMConfig("m", ("--kv-transfer-config", "{}"))
    vllm = fleet_engines([], 1, connected, prefill=1, decode=1)
    assert [e.role for e in vllm] == ["prefill", "decode"]
    with pytest.raises(ValueError, match="fleet"):
        fleet_engines(["m=1"], 1, ReplicaConfig(), prefill=1, decode=1)
