"""The guard every vLLM server runs under (replica/vllm_server.py's ``GUARD``), on plain
processes in place of vLLM: a stop ends as soon as the server has shut down, and a
server that ignores it is killed with its whole group once the grace has passed."""

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

from replica.vllm_server import GUARD
from tests.shared import wait_for

#: A server that says it is up, starts a child of its own, and waits.
SERVER = """\
import signal, subprocess, sys, time
{on_term}
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("up", flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def guarded(on_term: str, stop_s: float) -> Iterator[subprocess.Popen]:
    """A guard running :data:`SERVER`, up, with ``stop_s`` of grace; its group killed
    however the test ends."""
    code = SERVER.format(on_term=on_term)
    guard = subprocess.Popen(
        [sys.executable, "-c", GUARD, str(os.getpid()), sys.executable, "-c", code],
        env={**os.environ, "PREFIX_ROUTER_STOP_S": str(stop_s)},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert guard.stdout is not None and guard.stdout.readline() == "up\n"
        yield guard
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(guard.pid, signal.SIGKILL)
        guard.wait()
        guard.stdout.close()


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_stop_ends_as_soon_as_the_server_has_shut_down():
    """The server dies of the SIGTERM at once: the guard ends its group then, not
    after its grace (before, it waited out the whole grace: its handler waited on the
    server while the interrupted wait held the lock that reaps it)."""
    with guarded("", stop_s=600) as guard:
        guard.terminate()
        guard.wait(timeout=60)  # far within its 600 s of grace
        wait_for(lambda: group_gone(guard.pid), 10, "the server's process group")


def test_a_server_that_ignores_the_stop_is_killed_with_its_group_after_the_grace():
    with guarded("signal.signal(signal.SIGTERM, signal.SIG_IGN)", stop_s=0.5) as guard:
        guard.terminate()
        assert guard.wait(timeout=60) == -signal.SIGKILL
        wait_for(lambda: group_gone(guard.pid), 10, "the server's process group")
