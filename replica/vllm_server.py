"""A vLLM OpenAI server as a process we own: its command line, start, readiness, card, stop.

A vLLM replica is vLLM's own server (``python -m vllm.entrypoints.openai.api_server``),
started as a child process with the flags a router needs: its KV events published on
ZMQ in vLLM's format (bound on all interfaces, as vLLM binds only a wildcard or ipc
endpoint), ``cached_tokens`` in every answer's usage, and its development endpoints
(``/reset_prefix_cache``, which the bench uses between runs), and, given the fleet's
token, vLLM's ``--api-key`` (which guards ``/v1`` alone) and our guard on every other
path but ``/health`` (replica/api/fleet_token.py). On vLLM's CPU build it
also gets what a small replica on a shared machine needs (see :data:`CPU_DEFAULTS`).
Flags the user passes (``--engine-arg``, as vLLM names them) come last, so they win.

Each server runs in a work folder of its own, its ``TMPDIR`` (vLLM leaves IPC sockets
and files there), removed when it stops; vLLM's cache is one for every server
(:data:`SHARED_CACHE`), as vLLM's own default is. Every call here blocks: a Ray actor
runs them in a thread (``deploy/replicas.py``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from replica.api.card import EngineCard, vllm_card
from replica.api.config import ROLES
from replica.api.fleet_token import ENV_FLEET_TOKEN, FleetTokenGuard, bearer
from replica.api.stats import KVEventsEndpoint

log = logging.getLogger(__name__)

KV_TOPIC = "kv-events"
#: What a vLLM replica on vLLM's CPU build starts with: no graph capture (it only slows
#: the start on a CPU), blocks of 32 tokens (its attention kernel needs a multiple of 32;
#: its own default, 128, would make cache hits coarse), a KV cache of 256 MB (unless told,
#: it reserves 92% of a NUMA node's memory), and a context that fits that cache.
CPU_DEFAULTS = (
    "--enforce-eager",
    "--block-size",
    "32",
    "--kv-cache-memory-bytes",
    "256M",
    "--max-model-len",
    "8192",
)
#: The CPU build's environment: threads left unpinned (pinned, several servers on one
#: machine fight for the same cores).
CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
#: The fleet token's guard, as vLLM's ``--middleware`` names it (vLLM's own ``--api-key``
#: leaves every path outside ``/v1`` open: ``/tokenize``, ``/metrics``, dev endpoints).
GUARD_MIDDLEWARE = f"{FleetTokenGuard.__module__}.{FleetTokenGuard.__name__}"
#: What runs vLLM: a small guard in the server's process group, on the server's cores.
#: vLLM's server is several processes (its API server, its engine core, the CPU build's
#: worker), and a crash of the first leaves the others holding the ports and the memory.
#: The guard runs the server, and when the server exits, or the guard is told to stop
#: (SIGTERM, also sent by the kernel when its owner dies: Linux's parent-death signal),
#: it lets vLLM shut down (for at most ``$PREFIX_ROUTER_STOP_S``, 10 s), then kills what
#: is left of the group, itself included: no part of a server outlives it. (Its handler
#: must not wait for the server itself: the interrupted ``wait`` holds the lock that
#: reaps it, so a wait in the handler saw the server alive until its timeout, and every
#: stop took the whole 10 s where vLLM needs about one.) The guard itself may be killed outright
#: (Ray SIGKILLs an actor's children when the actor is killed): the server then gets
#: its own parent-death signal, SIGTERM, and shuts down its engine core as vLLM does.
GUARD = """\
import ctypes, os, signal, subprocess, sys
ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: told when the owner dies
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)  # the owner died before this line
if os.environ.get("PREFIX_ROUTER_CPUS"):  # the server's cores, inherited by its processes
    os.sched_setaffinity(0, {int(c) for c in os.environ["PREFIX_ROUTER_CPUS"].split(",")})
told = lambda: ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # when the guard dies
server = subprocess.Popen(sys.argv[2:], preexec_fn=told)
def stop(*_):  # the wait below goes on: it returns once the server has shut down
    server.terminate()
    signal.setitimer(signal.ITIMER_REAL, float(os.environ.get("PREFIX_ROUTER_STOP_S", "10")))
signal.signal(signal.SIGALRM, lambda *_: os.killpg(0, signal.SIGKILL))  # it took too long
signal.signal(signal.SIGTERM, stop)
server.wait()
os.killpg(0, signal.SIGKILL)
"""
#: A server's work folder (its log, vLLM's temporary and cache files) in the temporary
#: directory, and the file in it naming its guard's process.
WORK_PREFIX, OWNER_FILE = "prefix-router-vllm-", "guard.pid"
#: Lines of a failed server's log quoted in the error.
LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class VLLMConfig:
    """A vLLM replica: the model it serves and the flags its server starts with."""

    #: A Hugging Face model folder (``prefix-router tiny-model DIR`` writes one), or a
    #: hub name where the hub is reachable.
    model: str
    #: vLLM's own flags, as vLLM names them; they come after ours, so they win.
    engine_args: tuple[str, ...] = ()
    #: Loading, profiling and warming up may take this long before a start has failed.
    startup_timeout_s: float = 300.0
    #: On vLLM's CPU build, the cores the server runs on, one OpenMP thread each (empty:
    #: every core). Servers sharing a machine get cores of their own, as each would have
    #: its own GPU in a fleet: oversubscribed, their spinning threads made 32 cold
    #: prompts on two servers and two cores 2.7 times slower; and sharing every core,
    #: a server given all the traffic ran faster than two given half each.
    cpus: tuple[int, ...] = ()
    #: Its role in a disaggregated fleet (``both``, ``prefill``, ``decode``): what its
    #: card says, since vLLM does not (its KV connector is among ``engine_args``).
    role: str = "both"
    #: ``VLLM_SERVER_DEV_MODE=1``: its ``/reset_prefix_cache``, which the bench empties
    #: caches with between runs. It opens vLLM's other development endpoints (sleep,
    #: collective RPC, ...) to whoever reaches the server: off unless asked.
    dev_mode: bool = False

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("a vLLM replica needs a model (--model PATH)")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.startup_timeout_s <= 0:
            raise ValueError("startup_timeout_s must be positive")
        if any(cpu < 0 for cpu in self.cpus):
            raise ValueError(f"cpus must be core numbers, got {self.cpus}")
        if Path(self.model).is_absolute() and not Path(self.model).is_dir():
            raise ValueError(f"model folder {self.model!r} not found")


@dataclass(frozen=True)
class Ports:
    """Where one server listens: its HTTP API, its KV events, their replay."""

    http: int
    kv_events: int
    replay: int


#: vLLM's cache, shared by every server as vLLM shares ``~/.cache/vllm``: what it holds
#: (each model class's inspection, kept by vLLM's own source hash) saves a start the
#: ten seconds of a subprocess that imports torch to inspect the model class again.
SHARED_CACHE = Path(tempfile.gettempdir()) / "prefix-router-cache-vllm"  # not a WORK_PREFIX


def cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the ``vllm-cpu`` distribution)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def vllm_installed() -> bool:
    # Found, not imported: importing vLLM takes seconds and imports torch, whose
    # inductor leaves a folder in the temporary directory.
    return importlib.util.find_spec("vllm") is not None


class VLLMServer:
    """One vLLM server process on ``host`` (see the module docstring)."""

    def __init__(self, config: VLLMConfig, host: str, ports: Ports, fleet_token: str = "") -> None:
        self.config, self.host, self.ports = config, host, ports
        self.fleet_token = fleet_token
        self.url = f"http://{host}:{ports.http}"
        self.kv_events = KVEventsEndpoint(
            f"tcp://{host}:{ports.kv_events}", f"tcp://{host}:{ports.replay}", KV_TOPIC
        )
        self.process: subprocess.Popen | None = None
        self.workdir: Path | None = None

    def command(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # vLLM binds its PUB socket only to a wildcard (any other endpoint it
            # connects to: _is_bind_endpoint in vllm/distributed/kv_events.py); the
            # replay socket it binds as given, so that one listens on --host alone
            "endpoint": f"tcp://*:{self.ports.kv_events}",
            "replay_endpoint": f"tcp://{self.host}:{self.ports.replay}",
            "topic": KV_TOPIC,
        }
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.config.model,
            "--host",
            self.host,
            "--port",
            str(self.ports.http),
            "--kv-events-config",
            json.dumps(events),
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
            *(["--middleware", GUARD_MIDDLEWARE] if self.fleet_token else []),
            *(CPU_DEFAULTS if cpu_build() else ()),
            *self.config.engine_args,
        ]

    def environment(self, workdir: Path) -> dict[str, str]:
        env = {**os.environ, **(CPU_ENV if cpu_build() else {})}
        if cpu_build() and self.config.cpus:
            env["PREFIX_ROUTER_CPUS"] = ",".join(map(str, self.config.cpus))
            env["OMP_NUM_THREADS"] = str(len(self.config.cpus))
        if self.config.dev_mode:
            log.warning("vLLM server %s runs in dev mode (for /reset_prefix_cache)", self.url)
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.pop(ENV_FLEET_TOKEN, None)  # its guard's token is this server's, or none
        if self.fleet_token:  # in the environment, not on a command line others can read
            env |= {"VLLM_API_KEY": self.fleet_token, ENV_FLEET_TOKEN: self.fleet_token}
        env |= {
            "TMPDIR": str(workdir / "tmp"),
            "VLLM_CACHE_ROOT": str(SHARED_CACHE),
            "PYTHONUNBUFFERED": "1",
        }
        if Path(self.config.model).is_dir():  # a local model: never ask a hub for it
            env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        return env

    # ------------------------------------------------------------- life

    def start(self) -> None:
        """:meth:`launch`, then :meth:`wait_ready`."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process (at once). It is killed if the calling thread dies first, so
        call this from a thread that lives as long as the server should (a Ray actor's
        event loop, a test's main thread): a crashed owner leaves no server behind."""
        if self.alive():
            return
        if self.process is not None:  # what a crash may have left of the last one
            _signal_group(self.process, signal.SIGKILL)
        self._clean_up()
        remove_orphaned_folders()
        self.workdir = Path(tempfile.mkdtemp(prefix=WORK_PREFIX))
        (self.workdir / "tmp").mkdir()
        with open(self.workdir / "server.log", "w") as log:  # the child keeps its own copy
            self.process = subprocess.Popen(
                [sys.executable, "-c", GUARD, str(os.getpid()), *self.command()],
                env=self.environment(self.workdir),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stopped with every child
            )
        (self.workdir / OWNER_FILE).write_text(str(self.process.pid))

    def wait_ready(self) -> None:
        """Until the server answers ``/health``; raises ``RuntimeError`` quoting its log
        if it exits first, ``TimeoutError`` after ``startup_timeout_s`` (and stops it)."""
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"vLLM server {self.url} stopped while starting: {self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.25)
        raise TimeoutError(
            f"vLLM server {self.url} did not serve within {self.config.startup_timeout_s:.0f} s:"
            f"\n{self.log_tail()}"
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        if not self.alive():
            return False
        try:
            return httpx.get(f"{self.url}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def card(self, timeout_s: float = 5.0) -> EngineCard:
        """What the running server says of itself (block size and pool from its
        ``/metrics``, its model from ``/v1/models``)."""
        with httpx.Client(timeout=timeout_s, headers=bearer(self.fleet_token)) as client:
            metrics = client.get(f"{self.url}/metrics").text
            models = client.get(f"{self.url}/v1/models").json().get("data", [])
        pid = self.process.pid if self.process else None
        card = vllm_card(self.url, metrics, models, self.kv_events, pid)
        if card is None:
            raise RuntimeError(f"{self.url}/metrics has no vllm:cache_config_info")
        return replace(card, role=self.config.role)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to its guard (vLLM shuts down, then the guard ends its group), SIGKILL
        to the group after ``timeout_s``; its folder removed."""
        process = self.process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
        if process is not None:
            _signal_group(process, signal.SIGKILL)  # anything that outlived the guard
        self._clean_up()

    def kill(self) -> None:
        """SIGKILL to every process of the server, as a machine's crash would (its folder
        stays until the next start or stop)."""
        if self.process is not None and self.process.poll() is None:
            _signal_group(self.process, signal.SIGKILL)
            self.process.wait()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The log's last lines, after the first line that names an error (vLLM's root
        cause comes well before its last traceback)."""
        if self.workdir is None or not (self.workdir / "server.log").exists():
            return ""
        text = (self.workdir / "server.log").read_text(errors="replace").splitlines()
        errors = [line for line in text if " ERROR " in line]  # vLLM's log level
        cause = next((line for line in errors if "Error: " in line), errors[0] if errors else None)
        tail = text[-lines:]
        return "\n".join([cause, "...", *tail] if cause and cause not in tail else tail)

    def _clean_up(self) -> None:
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


def remove_orphaned_folders() -> None:
    """Remove the work folders of servers whose guard is gone without cleaning up (its
    owner killed outright): the next server started on the machine sweeps them."""
    for folder in Path(tempfile.gettempdir()).glob(WORK_PREFIX + "*"):
        try:
            os.kill(int((folder / OWNER_FILE).read_text()), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (OSError, ValueError):
            pass  # still being made, or not ours to judge


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def cores_of(index: int, servers: int, cores: int) -> tuple[int, ...]:
    """The cores of server ``index`` of ``servers`` sharing a machine's ``cores``: an
    equal share each, or one core per server, round robin, when there are more servers."""
    if servers <= cores:
        return tuple(range(index * cores // servers, (index + 1) * cores // servers))
    return (index % cores,)
