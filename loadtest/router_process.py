"""Another project's router as a process of its own (SGLang's, vLLM's): started on a
free loopback port in front of our replicas, waited for, and stopped however the
caller ends. Each router's module says how to start it and when it is ready."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import httpx


@contextlib.contextmanager
def router_process(
    name: str,
    command: Sequence[str],
    url: str,
    ready: Callable[[httpx.Response], bool],
    ready_path: str,
    startup_timeout_s: float,
    stop_timeout_s: float,
    log: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """Run ``command`` (a router listening at ``url``), yield ``url`` once its
    ``ready_path`` answers as ``ready`` says, and stop it on the way out, failures
    included. Its output goes to ``log`` (a file, not a pipe: a pipe nobody reads
    would stall it once full)."""
    with contextlib.ExitStack() as stack:
        if log is None:
            log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "router.log"
        output = stack.enter_context(open(log, "w"))
        process = subprocess.Popen(
            list(command),
            env={**os.environ, **(env or {})},
            stdout=output,
            stderr=output,
            start_new_session=True,  # a Ctrl-C meant for the bench is ours to pass on
        )
        try:
            wait_ready(name, url + ready_path, process, ready, startup_timeout_s, log)
            yield url
        finally:
            stop(process, stop_timeout_s)


def wait_ready(
    name: str,
    url: str,
    process: subprocess.Popen,
    ready: Callable[[httpx.Response], bool],
    timeout_s: float,
    log: Path,
) -> None:
    """Until ``url`` answers as ``ready`` says (the router then sees its workers)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            error = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{name} exited with {process.returncode}: {error}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if ready(httpx.get(url, timeout=1.0)):
                return
        time.sleep(0.2)
    raise TimeoutError(f"{name} at {url} was not ready in {timeout_s} s")


def stop(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it lingers."""
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
