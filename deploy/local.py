"""``prefix-router serve``: the embedded default deployment, in the foreground.

Starts a local Ray instance (bound to 127.0.0.1), N replica actors (simulated engines,
or vLLM servers: ``deploy/replicas.py``) and, once they serve, the gateway, configured
from what the first replica says of itself (model, tokenizer, block size), except
where the user said otherwise: one gateway in this process, or several as Ray actors
(``deploy/gateways.py``) sharing the port or on consecutive ports. Ctrl-C (or SIGTERM)
stops the gateways, the replicas (a vLLM server with its files) and Ray, in that order,
at any moment: while they start too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from deploy.engines import deployment_of, replica_actor
from deploy.fleet import scaling_text
from deploy.gateways import fleet_credentials, keep_token, start_gateways
from deploy.names import NAMESPACE, REPLICA_PREFIX
from deploy.replicas import EngineSpec, ready_cards, stop_replicas
from deploy.scaler import start_scaler
from deploy.serving import collect_garbage_rarely, listening_socket, serve_http
from replica.api.card import EngineCard
from replica.api.fleet_token import ENV_FLEET_TOKEN
from router.config import GatewayConfig
from router.fleet.autoscaler import AutoscaleConfig
from router.http.app import create_app


def start_local_ray(num_cpus: int | None = None) -> None:
    # A single-machine Ray binds to loopback only when it is told it is no cluster.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(
        # Its own Ray, never a cluster that `ray start` left running on this machine.
        address="local",
        num_cpus=num_cpus,
        namespace=NAMESPACE,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=100 * 1024 * 1024,
        log_to_driver=False,
        configure_logging=False,
    )


def serve(
    engines: Sequence[EngineSpec],
    gateway: GatewayConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    gateways: int = 1,
    separate_ports: bool = False,
    keep: Collection[str] = (),
    autoscale: AutoscaleConfig | None = None,
    open_replicas: bool = False,
) -> None:
    """Run until interrupted, a replica per engine of ``engines`` (they may serve several
    models: deploy/fleet.py); everything started here is stopped on the way out. The
    gateway's fields named in ``keep`` (the user's flags) are not taken from the engine.
    ``autoscale``: the fleet grows and shrinks within its bounds (deploy/scaler.py).
    The replicas answer only the fleet's token (made here, else the operator's), unless
    ``open_replicas``."""
    if len(engines) < 1 or gateways < 1:
        raise ValueError("serve needs at least one replica and one gateway")
    # The port first: a busy one fails at once, and Ray's processes cannot take it.
    sock = listening_socket(host, port) if gateways == 1 else None
    started = _Started()
    signals = _Signals()
    try:
        with signals.deferred():  # an interrupted ray.init leaves half a Ray behind
            start_local_ray()
        signals.install()  # ray.init sets a SIGTERM handler of its own
        credentials = fleet_credentials(open_replicas)
        started.token_file = keep_token(credentials.token, str(port))
        started.replicas = _start_replicas(engines, host, credentials.token)
        cards = ready_cards(started.replicas)
        _say_replicas(cards)
        _say_token(credentials.token, started.token_file)
        gateway = gateway.configured_by(cards[0], keep)
        if autoscale is not None:
            url = f"http://{host}:{port}"
            started.scaler = start_scaler(
                autoscale, engines, host, url, fleet_token=credentials.token
            )
            _say(scaling_text(autoscale, engines))
        if gateways == 1:
            _say(f"gateway: http://{host}:{port}/v1 (policy {gateway.policy})")
            app = create_app(
                gateway,
                ray_replica_prefix=REPLICA_PREFIX,
                secret=credentials.secret,
                fleet_token=credentials.token,
            )
            collect_garbage_rarely()
            serve_http(app, host, port, sock=sock)  # uvicorn's handlers, then it re-raises
            return
        ports = [port + i if separate_ports else port for i in range(gateways)]
        fronts, started.gateways = start_gateways(
            gateway, host, ports, backends=len(engines), credentials=credentials
        )
        for url in fronts:
            _say(f"gateway: {url}/v1 (policy {gateway.policy})")
        threading.Event().wait()
    except _Interrupted:
        pass
    finally:
        signals.ignore()
        if ray.is_initialized():  # else asking Ray for its actors would start one
            started.stop()
        ray.shutdown()
        if sock is not None:
            sock.close()
        signals.restore()


@dataclass
class _Started:
    """What ``serve`` started: stopped on the way out, whatever happened."""

    replicas: list[Any] = field(default_factory=list)
    #: Held until the end: an actor lives as long as its handle.
    gateways: list[Any] = field(default_factory=list)
    scaler: Any = None
    #: Where the fleet's token was written for the user (removed with the fleet).
    token_file: Path | None = None

    def stop(self) -> None:
        if self.scaler is not None:  # first: it starts no replica after this
            ray.kill(self.scaler, no_restart=True)
        for handle in self.gateways:
            ray.kill(handle, no_restart=True)
        stop_replicas([*self.replicas, *named_replicas()])  # those a scaler started too
        if self.token_file is not None:
            self.token_file.unlink(missing_ok=True)


def _start_replicas(engines: Sequence[EngineSpec], host: str, fleet_token: str) -> list[Any]:
    """A replica actor per engine, named in order (they start serving as they can),
    answering only requests that carry ``fleet_token``."""
    return [
        replica_actor(engine)
        .options(name=f"{REPLICA_PREFIX}{i}", num_cpus=0)
        .remote(deployment_of(engine).on_one_machine(engine, i, len(engines)), host, fleet_token)
        for i, engine in enumerate(engines)
    ]


def _say_token(token: str, path: Path | None) -> None:
    if not token:
        _say("replicas answer anyone (--open-replicas): keep them off every network")
        return
    where = f"in {path}" if path else f"${ENV_FLEET_TOKEN}'s"
    _say(f"replicas answer only requests carrying the fleet's token ({where}) as a bearer token")


def _say_replicas(cards: Sequence[EngineCard]) -> None:
    """The replicas' URLs, a line per model, in the order first seen."""
    for model in dict.fromkeys(card.model for card in cards):
        group = [card for card in cards if card.model == model]
        _say(f"{len(group)} replicas: {', '.join(c.url for c in group)} ({describe(group[0])})")


def _say(line: str) -> None:
    print(line, flush=True)


def named_replicas() -> list[Any]:
    """Every replica actor alive now, by its name (one gone meanwhile is skipped)."""
    handles = []
    for name in ray.util.list_named_actors():
        if name.startswith(REPLICA_PREFIX):
            with contextlib.suppress(ValueError):
                handles.append(ray.get_actor(name))
    return handles


def describe(card: EngineCard) -> str:
    """One replica's engine in a few words, for the start-up lines."""
    blocks = f"{card.num_blocks} blocks" if card.num_blocks else "its blocks"
    adapters = f" and adapters {', '.join(card.adapters)}" if card.adapters else ""
    return (
        f"{card.engine} engine serving {card.model}{adapters}, {blocks} of {card.block_size} tokens"
    )


class _Interrupted(Exception):
    """Ctrl-C or SIGTERM: ``serve`` stops, whether it serves or still starts."""


class _Signals:
    """Ctrl-C and SIGTERM, whenever they come, end ``serve`` through its clean-up: the
    first raises :class:`_Interrupted` where ``serve`` is (a blocking ``ray.get`` while
    it starts, its wait or uvicorn's re-raised signal once it serves); later ones are
    ignored, so the clean-up runs to its end and leaves no Ray behind. (Python's default
    SIGTERM would end the process at once, skipping the clean-up.)"""

    _HANDLED = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._interrupting = True
        self._deferring = self._pending = False
        self._previous = {signum: signal.getsignal(signum) for signum in self._HANDLED}
        self.install()

    def install(self) -> None:
        for signum in self._HANDLED:
            signal.signal(signum, self._handle)

    def _handle(self, *_: Any) -> None:
        if self._interrupting and not self._deferring:
            self._interrupting = False
            raise _Interrupted
        self._pending = self._pending or self._interrupting

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A signal inside waits until the block has ended, then interrupts."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending:
            self._interrupting = self._pending = False
            raise _Interrupted

    def ignore(self) -> None:
        self._interrupting = False

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
