"""The placement benchmark end to end on the CPU: two engines (`pensieve serve`, SmolLM2, each a
process of its own) on a nats-server with JetStream, engine 0 killed under load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_placement import main

pytestmark = pytest.mark.slow


def test_a_killed_engines_conversations_are_answered_again_and_none_is_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "placement.json"
    argv = [
        *("--model", "smollm2", "--cpu", "--runs", "2:load", "--per-engine"),
        *("--concurrency", "2", "--num-conversations", "8", "--max-turns", "4"),
        # engine 0 killed as soon as it has answered a turn: its conversation has turns to go
        *("--system-rules", "2", "--max-tokens", "4", "--failover", "0"),
        # a turn of the killed engine is sent again after this silence; one merely slow (the
        # CPU is shared) must not be: a copy sent while it runs is refused `conflict`
        *("--silence", "15", "--goodput", "e2el:600000", "--json", str(out)),
    ]
    assert main(argv) == 0
    (result,) = json.loads(out.read_text())
    assert result["engines"] == 2 and result["concurrency"] == 4  # 2 clients per engine
    failover = result["failover"]
    # the clients reached both engines, and the killed one held conversations with turns to go
    assert failover["conversations"] >= 1 and failover["recovered"] >= 1, failover
    assert failover["lost_turns"] == 0
    assert failover["kill_to_answer_s"]["max"] >= failover["kill_to_answer_s"]["p50"] > 0
    assert 0 < failover["kill_to_first_token_s"]["p50"] <= failover["kill_to_answer_s"]["p50"]
    assert result["errors"] == {}
    # every turn within a 10-minute objective: the goodput is the request rate
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    printed = capsys.readouterr().out
    assert "2 x load" in printed and "answered again" in printed and "goodput" in printed
