"""`pensieve bench agentic` against a real server (a real nats-server, the real SmolLM2, sessions of
real text): over NATS (a stateful client) and over the OpenAI API (a client that resends its
history every turn), every turn is served and measured, and the reported prompt sources are
what the engine counted. A client that resends recorded replies, not the server's, finds the
previous turn's prompt by content, and only by content; a long prompt beside the sessions is
reported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib import image

from pensieve.actors.ingress.http_actor import HttpConfig
from pensieve.actors.scheduler.chat_service import ChatService
from pensieve.actors.wire.schemas import Page
from pensieve.ops.agentic import AgenticConfig, Corpus, Span, Workload, corpus_chars, generate
from pensieve.ops.agentic_cli import chat_tokenizer
from pensieve.ops.cli import main
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
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


def check_run(run: dict[str, Any], generated: dict[str, Any], reused: bool = True) -> None:
    """A run that served every generated turn, each reply as long as asked (`reused`: later
    turns found what they may in the cache)."""
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
    reuse = run["reuse"]
    assert reuse["turns"] == generated["turns"] - generated["sessions"]
    if reused:  # later turns find the session's KV (the system prompt, the turns before)
        assert shares["gpu"] > 0.2 and shares["new"] > 0
        # all but a partial chunk or two of what the turn before left
        assert reuse["share_of_allowed"] > 0.8, reuse
    # the objective is loose: every turn and session meets it
    assert run["goodput"]["turns_share"] == 1 and run["goodput"]["sessions_share"] == 1
    assert run["goodput"]["turns_per_s"] == pytest.approx(run["turns_per_s"])


def check_prefix_cache(run: dict[str, Any]) -> None:
    """The engine's prefix-cache counters over the run are the replies' cached tokens."""
    cache = run["server"]["prefix_cache"]
    assert cache["queries"] == run["prompt_tokens"]
    assert cache["hits"] == run["cached_tokens"]
    assert cache["shared_hits"] == run["prompt_sources"]["shared"]
    assert cache["shared_chunks"] >= 0 and cache["bytes_saved"] >= 0


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
        assert run["prompt_sources"] == sources
        check_prefix_cache(run)
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
    assert "server" not in run  # no engine stats over HTTP without --nats-url

    def moved(name: str) -> float:
        return value(after, name) - value(before, name)

    assert moved("prompt_tokens_total") == run["prompt_tokens"]
    assert moved("generation_tokens_total") == run["output_tokens"]


def stored_turns(service: ChatService) -> list[tuple[int, str]]:
    """The prompt tokens and the reply of every turn the server stored."""
    ids = service.list(Page(limit=1000)).conversations
    return [(t.prompt_tokens, t.text) for c in ids for t in service.get(c).turns]


def recorded_prompts(workload: Workload) -> list[int]:
    """The prompt tokens of every turn, sent with the recorded replies."""
    chat = chat_tokenizer("smollm2")
    return sorted(
        len(chat.render(s.messages(workload.system, s.recorded(i))))  # type: ignore[arg-type]
        for s in workload.sessions
        for i in range(len(s.turns))
    )


def bench_recorded(
    smollm2, smollm2_chat, data: Path, sharing: bool, api: str
) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """Two runs, one after the other, that resend recorded replies over `api` (`--http`, else
    NATS with `--resend`) against a server with prefix sharing on or off, its stats read over
    NATS: the runs, and the turns the server stored."""
    built = assemble(EngineOptions(model="smollm2", prefix_sharing=sharing), smollm2, smollm2_chat)
    port = free_port()
    out = data / "run.json"
    with (
        EmbeddedNats() as server,
        serve_on_thread(
            built, data / "data", server.url, http=HttpConfig(port, model="smollm2")
        ) as (_, service),
    ):
        target = ["--http", f"http://127.0.0.1:{port}"] if api == "http" else ["--resend"]
        args = ["bench", "--nats-url", server.url, *target, *WORK, "--concurrency", "2,2"]
        assert main([*args, "--replies", "recorded", "--json", str(out)]) == 0
        stored = stored_turns(service)
    return json.loads(out.read_text())["runs"], stored


@pytest.mark.parametrize("api", ["http", "nats"])
def test_recorded_replies_resent_reuse_the_previous_turns_prompt_by_content(
    smollm2, smollm2_chat, tmp_path: Path, api: str
) -> None:
    """Every turn resends the recorded replies (so the chat is never one the server answered,
    and each turn opens a new conversation); a later turn still finds nearly all of the
    previous turn's prompt in the chunks that turn left, counted as shared."""
    workload = generate(TINY, Corpus.load(chat_tokenizer("smollm2"), corpus_chars(TINY)))
    runs, stored = bench_recorded(smollm2, smollm2_chat, tmp_path, True, api)
    # what was sent: the recorded replies, not the server's own
    assert sorted(prompt for prompt, _ in stored) == sorted(recorded_prompts(workload) * 2)
    recorded = {t.reply for s in workload.sessions for t in s.turns}
    assert not {reply for _, reply in stored} & recorded
    for run in runs:
        check_run(run, workload.summary())
        reuse = run["reuse"]
        assert 0 < reuse["prompt_sources"]["shared"] <= reuse["prompt_sources"]["gpu"]
        assert reuse["share_of_allowed"] <= 1
        check_prefix_cache(run)  # read over NATS beside the HTTP client too
        assert run["server"]["prefix_cache"]["sharing"] is True
    # each run has a cache salt of its own: the second finds nothing the first left (its first
    # turns at most the system prompt, should one session's come before the other's)
    first = runs[1]["reuse"]["first_turns"]
    assert first["cached_tokens"] < first["prompt_tokens"] / 2


def test_recorded_replies_find_nothing_without_prefix_sharing(
    smollm2, smollm2_chat, tmp_path: Path
) -> None:
    """The same client against a server that reuses only by conversation: no turn continues
    a chat the server answered, so none reuses anything."""
    workload = generate(TINY, Corpus.load(chat_tokenizer("smollm2"), corpus_chars(TINY)))
    runs, stored = bench_recorded(smollm2, smollm2_chat, tmp_path, False, "http")
    assert sorted(prompt for prompt, _ in stored) == sorted(recorded_prompts(workload) * 2)
    for run in runs:
        check_run(run, workload.summary(), reused=False)
        assert run["reuse"]["share_of_allowed"] < 0.05, run["reuse"]
        assert run["server"]["prefix_cache"]["sharing"] is False
        check_prefix_cache(run)


def test_a_long_prompt_beside_the_sessions_is_reported(
    smollm2, smollm2_chat, tmp_path: Path, capsys
) -> None:
    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    out = tmp_path / "long.json"
    work = [*WORK, "--output-tokens", "10:20", "--long-prompt", "600@0.2", "--concurrency", "2"]
    with EmbeddedNats() as server, serve_on_thread(built, tmp_path / "data", server.url):
        assert main(["bench", "--nats-url", server.url, *work, "--json", str(out)]) == 0
    found = json.loads(out.read_text())
    assert found["generated"]["long_prompt"] == {"num_tokens": 600, "at_s": 0.2}
    (run,) = found["runs"]
    assert not run["errors"] and run["sessions_completed"] == found["generated"]["sessions"]
    long = run["long_prompt"]
    assert long["error"] is None and 0.2 <= long["at_s"] < 0.5
    assert 600 < long["prompt_tokens"] < 660  # the text, in the chat template
    assert 0 < long["ttft_s"] <= long["latency_s"]
    assert long["gaps"]["rest"] > 0 and long["itl_rest_s"]["p50"] > 0
    # the server served it beside the sessions' turns
    assert run["server"]["requests_finished"] == run["turns"] + 1
    assert run["server"]["tokens"]["prompt"] == run["prompt_tokens"] + long["prompt_tokens"]
    assert "c=2 long prompt: 6" in capsys.readouterr().out
