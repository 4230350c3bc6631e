"""Real servers for tests: ``prefix-router`` subprocesses on free loopback ports."""

from deploy.processes import free_port, running, wait_until

__all__ = ["free_port", "running", "wait_until"]
