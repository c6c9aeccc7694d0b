"""`--turn-log`: LMDB alone by default (one engine, as before); the replicated log on JetStream
when asked, with what it needs checked before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from pensieve.ops.cli import build_parser
from pensieve.ops.cli_options import serve_options


def _options(tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["serve", "--data-dir", str(tmp_path), *extra])
    return serve_options(args)


def test_serve_keeps_its_store_alone_by_default(tmp_path: Path) -> None:
    options = _options(tmp_path)
    assert options.turn_log is False


def test_the_turn_log_goes_to_a_cluster_or_an_open_embedded_server(tmp_path: Path) -> None:
    cluster = _options(tmp_path, "--turn-log", "jetstream", "--nats-url", "nats://n1:4222")
    assert cluster.turn_log and cluster.turn_log_replicas == 0 and cluster.lease_ttl_s == 2.0
    assert _options(tmp_path, "--turn-log", "jetstream", "--insecure").turn_log
    with pytest.raises(ValueError, match="embedded server's accounts"):
        _options(tmp_path, "--turn-log", "jetstream")
    with pytest.raises(ValueError, match="--lease-ttl"):
        _options(tmp_path, "--turn-log", "jetstream", "--insecure", "--lease-ttl", "0")
