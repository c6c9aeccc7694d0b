"""`pensieve bench agentic` against a real server (a real nats-server, the real SmolLM2, sessions of
real text): over NATS (a stateful client) and over the OpenAI API (a client that resends its
history every turn), every turn is served and measured, and the reported prompt sources are
what the engine counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib import image

from pensieve.actors.ingress.http_actor import HttpConfig
from pensieve.ops.agentic import AgenticConfig, Corpus, Span, corpus_chars, generate
from pensieve.ops.agentic_cli import chat_tokenizer
from pensieve.ops.cli import main
from pensieve.ops.factory import EngineOptions, assemble
from pensieve.ops.nats_server import EmbeddedNats, free_port
from tests.ops.serving import scrape, serve_on_thread, value

pytestmark = pytest.mark.slow

# matplotlib's first two line colours, as 0-1 RGB
FIRST, SECOND = (0x1F / 255, 0x77 / 255, 0xB4 / 255), (0xFF / 255, 0x7F / 255, 0x0E / 255)


def coloured(picture: np.ndarray, rgb: tuple[float, float, float]) -> np.ndarray:
    """Which pixels are (nearly) `rgb`."""
    return np.all(np.abs(picture[..., :3] - np.array(rgb)) < 0.08, axis=-1)


TINY = AgenticConfig(
    num_sessions=2,
    system_tokens=450,
    turns_mean=2.5,
    added_tokens=Span(20, 50),
    output_tokens=Span(2, 5),
    max_context=2048,
    tool_time_s=0.05,
    seed=3,
)
WORK = [
    "agentic",
    "--sessions",
    "2",
    "--system-tokens",
    "450",
    "--turns-mean",
    "2.5",
    "--added-tokens",
    "20:50",
    "--output-tokens",
    "2:5",
    "--max-context",
    "2048",
    "--tool-time-s",
    "0.05",
    "--seed",
    "3",
    "--slo-ttft-s",
    "60",
    "--slo-tpot-ms",
    "60000",
]


def check_run(run: dict[str, Any], generated: dict[str, Any]) -> None:
    """A run that served every generated turn, each reply as long as asked."""
    assert not run["errors"] and run["sessions_completed"] == generated["sessions"]
    assert run["turns"] == generated["turns"] > generated["sessions"]
    assert run["output_tokens"] == generated["output_tokens"]
    for key in ("ttft_first_s", "ttft_later_s", "tpot_s", "itl_s", "latency_s", "session_s"):
        found = run[key]
        assert 0 < found["p50"] <= found["p90"] <= found["p99"], (key, found)
    assert run["ttft_first_s"]["p99"] < run["latency_s"]["p99"]
    assert run["turns_per_s"] > 0 and run["input_tok_per_s"] > run["output_tok_per_s"] > 0
    shares = run["prompt_share"]
    assert sum(shares.values()) == pytest.approx(1.0)
    # later turns find the session's KV (the system prompt and the turns before) on the GPU
    assert shares["gpu"] > 0.2 and shares["new"] > 0
    # the objective is loose: every turn and session meets it
    assert run["goodput"]["turns_share"] == 1 and run["goodput"]["sessions_share"] == 1
    assert run["goodput"]["turns_per_s"] == pytest.approx(run["turns_per_s"])


def test_agentic_sessions_over_nats_closed_and_open_loop(
    smollm2, smollm2_chat, tmp_path: Path, capsys
) -> None:
    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    out = tmp_path / "nats.json"
    with EmbeddedNats() as server, serve_on_thread(built, tmp_path / "data", server.url):
        args = ["bench", "--nats-url", server.url, *WORK, "--label", "nats"]
        closed = [
            *args,
            "--concurrency",
            "2",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "a.png"),
        ]
        assert main(closed) == 0
        opened = [*args[:-1], "open", "--rates", "5", "--json", str(tmp_path / "open.json")]
        assert main(opened) == 0
    table = capsys.readouterr().out
    assert "nats c=2" in table and "open 5/s" in table
    found = json.loads(out.read_text())
    assert found["workload"] == "agentic" and found["label"] == "nats"
    generated = found["generated"]
    workload = generate(TINY, Corpus.load(chat_tokenizer("smollm2"), corpus_chars(TINY)))
    assert generated == workload.summary()  # the options make the config above
    (opened,) = json.loads((tmp_path / "open.json").read_text())["runs"]
    assert opened["session_rate"] == 5
    for run in [*found["runs"], opened]:
        check_run(run, generated)
        # what the engine counted while the run went on
        server = run["server"]
        assert server["requests_finished"] == run["turns"]
        assert server["tokens"]["prompt"] == run["prompt_tokens"], server["tokens"]
        sources = server["tokens"]["prompt_sources"]
        assert {**run["cached_tokens"], "new": run["new_prompt_tokens"]} == sources
    assert [r["concurrency"] for r in found["runs"]] == [2]
    assert (tmp_path / "a.png").stat().st_size > 10_000
    # both sweeps in each of the four panels, each in its colour
    again = ["bench", "agentic", "--replot", "--plot", str(tmp_path / "b.png"), "--compare"]
    assert main([*again, str(out), str(tmp_path / "open.json")]) == 0
    picture = image.imread(tmp_path / "b.png")
    height, width = picture.shape[:2]
    plots = picture[: int(height * 0.93)]  # the panels, without the legend under them
    for top in (0, plots.shape[0] // 2):
        for left in (0, width // 2):
            panel = plots[top : top + plots.shape[0] // 2, left : left + width // 2]
            assert coloured(panel, FIRST).sum() > 40 and coloured(panel, SECOND).sum() > 40


def test_agentic_sessions_over_http_resend_their_history_and_hit_the_cache(
    smollm2, smollm2_chat, tmp_path: Path
) -> None:
    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    port = free_port()
    http = HttpConfig(port, model="smollm2")
    out = tmp_path / "http.json"
    with EmbeddedNats() as server, serve_on_thread(built, tmp_path / "data", server.url, http=http):
        before = scrape(f"http://127.0.0.1:{port}/metrics")
        args = ["bench", "--http", f"http://127.0.0.1:{port}", *WORK, "--concurrency", "2"]
        assert main([*args, "--json", str(out)]) == 0
        after = scrape(f"http://127.0.0.1:{port}/metrics")
    (run,) = json.loads(out.read_text())["runs"]
    check_run(run, json.loads(out.read_text())["generated"])
    assert "server" not in run  # no engine stats over HTTP

    def moved(name: str) -> float:
        return value(after, name) - value(before, name)

    assert moved("prompt_tokens_total") == run["prompt_tokens"]
    assert moved("generation_tokens_total") == run["output_tokens"]
