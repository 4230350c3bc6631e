"""The sockets our servers listen on."""

import socket

from deploy.serving import listening_socket


def test_a_held_port_takes_connections_before_its_server_starts():
    """`serve` holds its port, then starts Ray and the replicas before the gateway's
    server runs: a client that connects in between waits instead of being refused."""
    held = listening_socket("127.0.0.1", 0)
    try:
        with socket.create_connection(held.getsockname(), timeout=5):
            pass  # accepted into the backlog; no server has run yet
    finally:
        held.close()
