"""How one completion request walks through the gateway's modules: the measure of issue 39.

Issue 39 ("A request zig-zags through a hub") counted by reading code that a request
took 27 steps in 11 modules and came back 16 times to a module it had left (app ->
intake -> app -> tenants -> app -> fairness -> gateway -> app -> upstream -> ...).
Reading code misses dynamic dispatch and is easy to bend, so this measures the walk on
the running code, the same way before and after the request path became stages.

A simulated replica runs as a subprocess; the gateway app runs in this process, under
uvicorn, in the same event loop as the client. After a few warm-up chats, one short
non-streamed ``/v1/chat/completions`` request is traced with ``sys.setprofile``:

- only frames whose code lies under the imported ``router`` package count, each named
  by its module relative to ``router/`` (``gateway``, ``path/resolve``, ``http/app``);
- only the request's own asyncio task counts: the one in which the app's completion
  handler is first called. Recording starts at that call and stops at the first call
  of the upstream client's ``post`` (``fleet/http_client``; ``http_client`` before),
  which is the walk's last step;
- a genuine call steps into the callee's module; a genuine return steps back to the
  module of the nearest router frame up the ``f_back`` chain. A coroutine suspending
  (a ``return`` event at a ``YIELD_VALUE``) or resuming (a ``call`` event for a frame
  still open, or one at a ``RESUME`` after a yield, or a ``throw`` into it) is
  neither. Consecutive repeats collapse.

The walk is printed twice: whole, and along the request path only, where every
module of the rooms below the path (tenants, fairness, models, keys, the policies,
the index, the load, the counters) folds into the path module that called it: the
path's own modules are ``app``, ``intake``, ``gateway`` and ``upstream`` before, and
``http/app``, ``gateway`` and the stages ``path/envelope``, ``resolve``, ``admit``,
``place``, ``dispatch`` and ``settle`` after. For each it prints the walk, its steps,
how many steps go back to a module it had left and how often each module was
entered; for the whole walk also its distinct modules, and the router calls made in
other tasks while it traced (which the walk leaves out). The bytecode tests are
CPython 3.11's.

The repository measured is the one the imported ``router`` package comes from, so the
script can measure an old checkout by putting it first on ``PYTHONPATH``; the replica
runs from that checkout too.

After (this tree)::

    cd /work/main && .venv/bin/python -m benchmarks.request_walk

Before (commit 39139a3 checked out at /tmp/base-tree)::

    cd /tmp/base-tree && PYTHONPATH=/tmp/base-tree \\
        /work/main/.venv/bin/python /work/main/benchmarks/request_walk.py
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dis
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

import httpx
import uvicorn

import router
from deploy.processes import free_port, stop
from router.config import GatewayConfig

#: Where ``create_app`` lives: after the rooms of issue 39, then before.
APP_MODULES = ("router.http.app", "router.app")
#: The app's module relative to ``router/`` (after, before), and its completion handlers:
#: the first one called opens the walk.
APP_WALK_MODULES = frozenset({"http/app", "app"})
HANDLERS = frozenset({"completions", "chat_completions", "_route"})
#: The upstream client's module (after, before); its ``post`` closes the walk.
CLIENT_MODULES = frozenset({"fleet/http_client", "http_client"})
CLIENT_CALL = "post"
YIELD_VALUE, RESUME = dis.opmap["YIELD_VALUE"], dis.opmap["RESUME"]
#: The simulated replica's server (replica/server.py), served as the ``replica`` command
#: serves it, but started without the command line: that imports every package, the
#: replica needs only its own.
REPLICA_SERVER = """
import sys
import uvicorn
from replica.api.config import ReplicaConfig
from replica.server import create_app
app = create_app(ReplicaConfig(speedup=100.0, host_blocks=0), kv_events_host="127.0.0.1")
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""
SYSTEM = "You answer questions about the fleet of a bicycle shop. " * 8
WARM_UPS = 3


class WalkError(RuntimeError):
    """The measurement could not be made (a server did not come up, a request failed)."""


# ------------------------------------------------------------------ the tracer


def _suspends(frame: FrameType) -> bool:
    """A ``return`` event that is a coroutine or generator pausing at a yield."""
    return frame.f_lasti >= 0 and frame.f_code.co_code[frame.f_lasti] == YIELD_VALUE


def _resumes(frame: FrameType) -> bool:
    """A ``call`` event that is a paused frame going on: at a ``RESUME`` after a yield
    or an await (a fresh call's has oparg 0), or at the yield a ``throw`` enters by."""
    code, lasti = frame.f_code.co_code, frame.f_lasti
    if lasti < 0:
        return False
    return code[lasti] == YIELD_VALUE or (code[lasti] == RESUME and code[lasti + 1] > 0)


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop: not the request's task
        return None


class WalkTracer:
    """A ``sys.setprofile`` function building the request's walk through router modules.

    ``walk`` grows from the first handler call in the app module until the first call
    of the upstream client's ``post`` (then ``reached_upstream``); ``elsewhere`` counts,
    per module, the router calls other tasks made meanwhile.
    """

    def __init__(self, package: Path) -> None:
        self._prefix = str(package.resolve()) + os.sep
        self._modules: dict[str, str | None] = {}
        self._open: set[FrameType] = set()  # frames, not ids: an id is reused once freed
        self._task: asyncio.Task[Any] | None = None
        self.walk: list[str] = []
        self.elsewhere: collections.Counter[str] = collections.Counter()
        self.reached_upstream = False

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            self._on_call(frame)
        elif event == "return":
            self._on_return(frame)

    def module_of(self, filename: str) -> str | None:
        """``filename``'s module relative to ``router/`` (``path/resolve``), or ``None``
        for code outside it."""
        if filename not in self._modules:
            path = os.path.realpath(filename)
            inside = path.startswith(self._prefix) and path.endswith(".py")
            name = path[len(self._prefix) : -len(".py")].removesuffix("/__init__")
            self._modules[filename] = name if inside else None
        return self._modules[filename]

    def _recording(self) -> bool:
        return self._task is not None and not self.reached_upstream

    def _on_call(self, frame: FrameType) -> None:
        module = self.module_of(frame.f_code.co_filename)
        if module is None or frame in self._open or _resumes(frame):
            return
        self._open.add(frame)
        if self._task is None:
            if module in APP_WALK_MODULES and frame.f_code.co_name in HANDLERS:
                self._task = _current_task()
                self._step(module)
        elif self._recording():
            self._record_call(module, frame.f_code.co_name)

    def _record_call(self, module: str, name: str) -> None:
        if _current_task() is not self._task:
            self.elsewhere[module] += 1
            return
        self._step(module)
        self.reached_upstream = module in CLIENT_MODULES and name == CLIENT_CALL

    def _on_return(self, frame: FrameType) -> None:
        if self.module_of(frame.f_code.co_filename) is None or _suspends(frame):
            return
        self._open.discard(frame)
        if not self._recording() or _current_task() is not self._task:
            return
        caller = self._caller_module(frame.f_back)
        if caller is not None:
            self._step(caller)

    def _caller_module(self, frame: FrameType | None) -> str | None:
        """The module of the nearest router frame from ``frame`` up."""
        while frame is not None:
            module = self.module_of(frame.f_code.co_filename)
            if module is not None:
                return module
            frame = frame.f_back
        return None

    def _step(self, module: str) -> None:
        if not self.walk or self.walk[-1] != module:
            self.walk.append(module)


# ------------------------------------------------------------------ the figures


@dataclass(frozen=True)
class WalkFigures:
    """What one traced request's walk comes to."""

    root: str
    walk: list[str]
    steps: int
    modules: int
    #: Steps into a module that appears earlier in the walk.
    returns: int
    #: Per module, in the order first entered: how many steps enter it.
    entered: dict[str, int]
    #: Router calls in other tasks (or none) while the walk was traced.
    outside_task: dict[str, int]
    reached_upstream: bool
    #: The same along the request path's own modules (see the module's doc).
    path_walk: list[str]
    path_steps: int
    path_returns: int
    path_entered: dict[str, int]


#: The request path's own modules, before (app ... upstream) and after it became stages.
PATH_MODULES = frozenset(
    {"app", "intake", "gateway", "upstream", "http/app"}
    | {f"path/{stage}" for stage in ("envelope", "resolve", "admit", "place", "dispatch", "settle")}
)


def along_the_path(walk: list[str]) -> list[str]:
    """The walk with every module below the path folded into the path module that
    called it (and the upstream client, its last step, kept)."""
    path: list[str] = []
    for module in walk:
        if (module in PATH_MODULES or module in CLIENT_MODULES) and path[-1:] != [module]:
            path.append(module)
    return path


def _returns(walk: list[str]) -> int:
    return sum(module in walk[:i] for i, module in enumerate(walk))


def figures(root: Path, tracer: WalkTracer) -> WalkFigures:
    walk = tracer.walk
    path = along_the_path(walk)
    return WalkFigures(
        root=str(root),
        walk=walk,
        steps=len(walk),
        modules=len(set(walk)),
        returns=_returns(walk),
        entered=dict(collections.Counter(walk)),
        outside_task=dict(tracer.elsewhere.most_common()),
        reached_upstream=tracer.reached_upstream,
        path_walk=path,
        path_steps=len(path),
        path_returns=_returns(path),
        path_entered=dict(collections.Counter(path)),
    )


def report(figures: WalkFigures) -> str:
    lines = [
        f"request walk of {figures.root}/router (one non-streamed chat completion)",
        "walk: " + " -> ".join(figures.walk),
        f"steps: {figures.steps}   modules: {figures.modules}   "
        f"returns to a module it had left: {figures.returns}",
        "entered per module:",
        *(f"  {module:<24} {count}" for module, count in figures.entered.items()),
        "along the request path (the rooms below it folded into their caller):",
        "  " + " -> ".join(figures.path_walk),
        f"  steps: {figures.path_steps}   returns to a module it had left: "
        f"{figures.path_returns}   entered: "
        + ", ".join(f"{m} {n}" for m, n in figures.path_entered.items()),
    ]
    if figures.outside_task:
        calls = ", ".join(f"{m} {n}" for m, n in figures.outside_task.items())
        lines.append(f"router calls in other tasks meanwhile (not in the walk): {calls}")
    if not figures.reached_upstream:
        lines.append(f"WARNING: the upstream client's {CLIENT_CALL} was never called")
    return "\n".join(lines)


# ------------------------------------------------------------------ the servers


def repository_root() -> Path:
    """The checkout the imported ``router`` package comes from (not this file's)."""
    return Path(router.__file__).resolve().parent.parent


def create_app() -> Callable[..., Any]:
    for name in APP_MODULES:
        with contextlib.suppress(ModuleNotFoundError):
            factory: Callable[..., Any] = importlib.import_module(name).create_app
            return factory
    raise WalkError(f"no create_app in {' or '.join(APP_MODULES)}")


@contextlib.contextmanager
def replica(root: Path, timeout_s: float) -> Iterator[str]:
    """A simulated replica of ``root``'s code on a free loopback port: its URL once it
    answers ``/health``; stopped however the caller ends."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-c", REPLICA_SERVER, str(port)]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(
            command,
            cwd=root,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
            start_new_session=True,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, process, log, timeout_s)
            yield url
        finally:
            stop(process, timeout_s=10.0)


def _wait_healthy(url: str, process: subprocess.Popen, log: IO[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise WalkError(f"the replica exited with {process.returncode}: {_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise WalkError(f"the replica at {url} did not come up in {timeout_s} s: {_tail(log)}")


def _tail(log: IO[str], chars: int = 2000) -> str:
    log.seek(0)
    return log.read()[-chars:] or "(nothing on stderr)"


@contextlib.asynccontextmanager
async def gateway(backend: str, timeout_s: float) -> AsyncIterator[str]:
    """The gateway app routing to ``backend``, served by uvicorn in this event loop."""
    port = free_port()
    app = create_app()(GatewayConfig(), backends=[backend])
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    serving = asyncio.get_running_loop().create_task(server.serve())
    try:
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if serving.done() or time.monotonic() > deadline:
                raise WalkError(f"the gateway did not start on port {port}")
            await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, 10.0)


# ------------------------------------------------------------------ the request


def chat(question: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    model = GatewayConfig().model
    return {"model": model, "messages": messages, "max_tokens": 4, "ignore_eos": True}


async def wait_checked(client: httpx.AsyncClient, url: str, timeout_s: float) -> None:
    """Until the gateway has checked its backend (its canary prompts answered)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        backends = (await client.get(f"{url}/stats")).json().get("backends", [])
        if backends and all(b.get("routing_mode") != "checking" for b in backends):
            return
        await asyncio.sleep(0.1)
    raise WalkError(f"the gateway did not finish checking its backend in {timeout_s} s")


async def post_chat(client: httpx.AsyncClient, url: str, question: str) -> None:
    response = await client.post(f"{url}/v1/chat/completions", json=chat(question))
    if response.status_code != 200:
        raise WalkError(f"{question!r} answered {response.status_code}: {response.text}")


async def traced(client: httpx.AsyncClient, url: str, tracer: WalkTracer) -> None:
    sys.setprofile(tracer)
    try:
        await post_chat(client, url, "How do I true a wheel?")
    finally:
        sys.setprofile(None)


async def measure(root: Path, backend: str, timeout_s: float) -> WalkTracer:
    tracer = WalkTracer(root / "router")
    async with gateway(backend, timeout_s) as url, httpx.AsyncClient(timeout=timeout_s) as client:
        await wait_checked(client, url, timeout_s)
        for i in range(WARM_UPS):
            await post_chat(client, url, f"Warm-up question {i}?")
        await traced(client, url, tracer)
    return tracer


def run(timeout_s: float) -> WalkFigures:
    root = repository_root()
    with replica(root, timeout_s) as backend:
        try:
            tracer = asyncio.run(asyncio.wait_for(measure(root, backend, timeout_s), timeout_s))
        except TimeoutError as error:
            raise WalkError(f"the measurement took over {timeout_s} s") from error
        except httpx.HTTPError as error:
            raise WalkError(f"a request to the gateway failed: {error!r}") from error
    return figures(root, tracer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=60.0,
        help="the limit of each wait and of the whole measurement",
    )
    args = parser.parse_args(argv)
    try:
        result = run(args.timeout_s)
    except WalkError as error:
        print(f"request_walk: {error}", file=sys.stderr)
        return 1
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(result), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
