"""A vLLM server as a process we own: its command line and a start that fails with the
reason (a crash that leaves nothing of the server behind is the last test of
tests/router/test_vllm_backends.py, on that module's servers)."""

import pytest

from deploy.processes import free_port
from replica.vllm_server import (
    CPU_DEFAULTS,
    Ports,
    VLLMConfig,
    VLLMServer,
    cores_of,
    cpu_build,
)


def server(
    model: str, *engine_args: str, cpus: tuple[int, ...] = (), dev_mode: bool = False
) -> VLLMServer:
    ports = Ports(free_port(), free_port(), free_port())
    config = VLLMConfig(model, engine_args, cpus=cpus, dev_mode=dev_mode)
    return VLLMServer(config, "127.0.0.1", ports)


def test_the_users_flags_come_after_ours_and_the_cpu_builds_defaults(tiny_model):
    made = server(str(tiny_model), "--block-size", "64")
    command = made.command()
    assert command[command.index("--model") + 1] == str(tiny_model)
    assert "--enable-prompt-tokens-details" in command  # cached_tokens in every answer
    events = command[command.index("--kv-events-config") + 1]
    assert f'"endpoint": "tcp://*:{made.ports.kv_events}"' in events  # bound, not connected
    # the replay socket is bound as given: on --host only (vLLM binds PUB to wildcards only)
    assert f'"replay_endpoint": "tcp://127.0.0.1:{made.ports.replay}"' in events
    assert command[-2:] == ["--block-size", "64"]  # last: vLLM's parser keeps the last one
    assert cpu_build() and command.index(CPU_DEFAULTS[0]) < command.index("64")
    assert made.kv_events.endpoint == f"tcp://127.0.0.1:{made.ports.kv_events}"


def test_a_server_on_cores_of_its_own_gets_a_thread_per_core(tmp_path, tiny_model):
    env = server(str(tiny_model), cpus=(1,)).environment(tmp_path)
    assert (env["PREFIX_ROUTER_CPUS"], env["OMP_NUM_THREADS"]) == ("1", "1")
    assert env["TMPDIR"] == str(tmp_path / "tmp") and "VLLM_SERVER_DEV_MODE" not in env
    dev = server(str(tiny_model), dev_mode=True).environment(tmp_path)  # bench's replicas
    assert dev["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1"  # a local model: no hub is ever asked
    assert "PREFIX_ROUTER_CPUS" not in server(str(tiny_model)).environment(tmp_path)
    assert [cores_of(i, 2, 4) for i in range(2)] == [(0, 1), (2, 3)]
    assert [cores_of(i, 3, 2) for i in range(3)] == [(0,), (1,), (0,)]
    with pytest.raises(ValueError, match="cpus"):
        VLLMConfig(str(tiny_model), cpus=(-1,))
    with pytest.raises(ValueError, match="not found"):
        VLLMConfig("/no/such/model")


@pytest.mark.slow
@pytest.mark.vllm
def test_a_start_that_fails_says_why_and_leaves_no_folder(tiny_model):
    # Longer than the model's positions: vLLM refuses it before loading any weights.
    failing = server(str(tiny_model), "--max-model-len", "1000000")
    with pytest.raises(RuntimeError, match="stopped while starting") as error:
        failing.start()
    assert "max_model_len" in str(error.value)  # vLLM's own reason, quoted from its log
    assert failing.workdir is None and not failing.alive()
