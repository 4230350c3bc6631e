"""The Serve config file `prefix-router serve-config` writes, deployed with `serve
deploy` onto a `ray start` cluster (a module of its own: `ray stop` ends every Ray of
the machine)."""

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from deploy.processes import free_port
from tests.deploy.test_ray_serve import SYSTEM, chat
from tests.shared import loopback_env, prefix_router, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def serve_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    serve_command = os.path.join(os.path.dirname(sys.executable), "serve")
    return subprocess.run(
        [serve_command, *args], capture_output=True, text=True, env=env, timeout=180, check=False
    )


def test_the_config_file_deploys_with_serve_deploy_on_a_ray_start_cluster(tmp_path: Path):
    ray_command = os.path.join(os.path.dirname(sys.executable), "ray")
    # `serve deploy` talks to the dashboard, which asks for Ray's token (on by default)
    env = loopback_env(RAY_AUTH_MODE="token")
    assert subprocess.run([ray_command, "get-auth-token", "--generate"], env=env).returncode == 0
    gcs, dashboard, port = free_port(), free_port(), free_port()
    head = [ray_command, "start", "--head", "--port", str(gcs), "--num-cpus", "2"]
    head += ["--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard)]
    try:
        started = subprocess.run([*head, "--disable-usage-stats"], env=env, capture_output=True)
        assert started.returncode == 0, started.stderr
        config = tmp_path / "serve_config.yaml"
        written = prefix_router(
            "serve-config", "--port", str(port), "--replica-speedup", "100", "-o", str(config)
        )
        assert written.returncode == 0, written.stderr
        address = ["-a", f"http://127.0.0.1:{dashboard}"]
        deployed = serve_cli("deploy", str(config), *address, env=env)
        assert deployed.returncode == 0, deployed.stderr
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:

            def answers() -> bool:
                try:
                    return client.get("/health").status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(answers, timeout_s=120, what="the deployed application's ingress")
            assert chat(client, SYSTEM, "one") == 0
            assert chat(client, SYSTEM, "two") >= 16 * 62  # routed where the first went
            assert len(client.get("/engines").json()) == 2
        assert serve_cli("shutdown", "-y", *address, env=env).returncode == 0
    finally:
        subprocess.run([ray_command, "stop", "--force"], env=env, capture_output=True)
