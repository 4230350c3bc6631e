"""Ports handed out for a server to bind later."""

import random
import socket

from deploy.processes import EPHEMERAL_RANGE_FILE, free_port


def test_a_handed_out_port_lies_below_the_ephemeral_range_and_is_free():
    with open(EPHEMERAL_RANGE_FILE) as lines:
        ephemeral_low = int(lines.read().split()[0])
    for seed in range(20):
        port = free_port(rng=random.Random(seed))
        assert 20000 <= port < ephemeral_low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_taken_port_is_not_handed_out():
    rng_state = random.Random(7)
    first = free_port(rng=random.Random(7))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first))
        taken.listen()
        assert free_port(rng=rng_state) != first
