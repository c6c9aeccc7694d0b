"""The HTTP ingress relay benchmark (`benchmarks/http_relay.py`): a real nats-server, the real
HTTP ingress in a process of its own, real HTTP clients; every delta arrives as an event."""

from __future__ import annotations

from benchmarks import http_relay


def test_every_delta_of_every_turn_reaches_the_client_as_one_event() -> None:
    got = http_relay.main(["--concurrency", "4", "--turns", "12", "--tokens", "40"])
    # each turn's stream: the role's chunk, one chunk per delta, the finish reason's chunk
    assert got["events"] == 12 * (40 + 2)
    assert got["deltas"] == 480
    assert got["cpu_s"] > 0 and got["wall_s"] > 0
