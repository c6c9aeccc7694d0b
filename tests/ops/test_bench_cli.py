"""`pensieve bench` against a real server (a real nats-server, the real SmolLM2, real ShareGPT
conversations): a Poisson rate sweep and a closed-loop run report every turn; the table, the
JSON and the plot hold what was measured, and the plot draws one line per labelled sweep."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest

from pensieve.actors.ingress.http_actor import HttpConfig
from pensieve.ops.cli import main
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
from pensieve.ops.nats_server import EmbeddedNats, free_port
from pensieve.ops.openai_client import OpenAIChatClient
from pensieve.ops.sweep import served_at_bound
from tests.ops.serving import scrape, serve_on_thread, value

pytestmark = pytest.mark.slow

# matplotlib's first two line colours, as 0-1 RGB
FIRST, SECOND = (0x1F / 255, 0x77 / 255, 0xB4 / 255), (0xFF / 255, 0x7F / 255, 0x0E / 255)


def coloured(image: np.ndarray, rgb: tuple[float, float, float]) -> np.ndarray:
    """Which pixels are (nearly) `rgb`."""
    return np.all(np.abs(image[..., :3] - np.array(rgb)) < 0.08, axis=-1)


def test_a_rate_sweep_is_measured_tabled_and_plotted_beside_another(
    smollm2, smollm2_chat, sharegpt20, tmp_path, capsys
) -> None:
    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    work = [
        str(sharegpt20),
        "--num-conversations",
        "3",
        "--max-turns",
        "2",
        "--max-tokens",
        "4",
        "--ignore-eos",
    ]
    with EmbeddedNats() as server, serve_on_thread(built, tmp_path / "data", server.url):
        url = ["--nats-url", server.url]
        closed = ["bench", *url, *work, "--concurrency", "2", "--label", "closed"]
        assert main(closed) == 0
        assert "closed c=2" in capsys.readouterr().out
        first = [
            "bench",
            *url,
            *work,
            "--rates",
            "2,8",
            "--think-time",
            "0.1",
            "--label",
            "first",
            "--json",
            str(tmp_path / "first.json"),
        ]
        assert main(first) == 0
        second = [
            "bench",
            *url,
            *work,
            "--rates",
            "1,4",
            "--label",
            "second",
            "--json",
            str(tmp_path / "second.json"),
            "--plot",
            str(tmp_path / "rates.png"),
            "--compare",
            str(tmp_path / "first.json"),
        ]
        assert main(second) == 0
        # a timed run: conversations come again once all have come, warm-up turns don't count
        few = [
            "bench",
            *url,
            str(sharegpt20),
            "--num-conversations",
            "2",
            "--max-turns",
            "2",
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--rates",
            "4",
        ]
        timed = ["--duration", "4", "--warmup", "1", "--json", str(tmp_path / "timed.json")]
        assert main([*few, *timed]) == 0
        assert main([*few, "--warmup", "1"]) == 2  # a warm-up needs a duration
    (run,) = json.loads((tmp_path / "timed.json").read_text())["runs"]
    assert run["window_s"] == [1, 4] and not run["errors"]
    assert run["turns"] > 2 * 2  # more than the two conversations' turns, taken once
    assert run["server"]["requests_finished"] > run["turns"]  # the warm-up's are left out
    out = capsys.readouterr().out
    for row in ("first 2/s", "first 8/s", "second 1/s", "second 4/s"):
        assert row in out
    sweep = json.loads((tmp_path / "first.json").read_text())
    assert sweep["label"] == "first" and [r["request_rate"] for r in sweep["runs"]] == [2, 8]
    for run in sweep["runs"]:
        assert run["turns"] == 6 and run["output_tokens"] == 24 and not run["errors"]
        assert run["prompt_sources"]["gpu"] > 0  # second turns came from the KV the first left
        assert 0 < run["ttft_s_p50"] <= run["latency_s_p50"]

    from matplotlib import image

    picture = image.imread(tmp_path / "rates.png")
    height, width = picture.shape[:2]
    plots = picture[: int(height * 0.85)]  # the panels, without the legend under them
    for panel in (plots[:, : width // 2], plots[:, width // 2 :]):  # latency, then TTFT
        # each sweep drawn in each panel: at least its two markers of its colour
        assert coloured(panel, FIRST).sum() > 80 and coloured(panel, SECOND).sum() > 80
    legend = picture[int(height * 0.85) :]
    assert coloured(legend, FIRST).any() and coloured(legend, SECOND).any()
    # the same picture again from the two sweeps' JSON, with no server to load
    again = [
        "bench",
        "--replot",
        "--plot",
        str(tmp_path / "again.png"),
        "--compare",
        str(tmp_path / "second.json"),
        str(tmp_path / "first.json"),
    ]
    assert main(again) == 0
    assert np.array_equal(image.imread(tmp_path / "again.png"), picture)
    assert main(["bench", "--replot", "--plot", str(tmp_path / "none.png")]) == 2
    # what the first sweep served where its p90 normalized latency is halfway between its runs'
    low, high = sorted(sweep["runs"], key=lambda r: r["turns_per_s"])
    bound = (low["norm_latency_s_p90"] + high["norm_latency_s_p90"]) / 2
    halfway = f"{(low['turns_per_s'] + high['turns_per_s']) / 2:.2f} requests/s"
    capsys.readouterr()
    assert main(["bench", "--replot", "--bound", str(bound), "--compare", again[-1]]) == 0
    said = capsys.readouterr().out
    rising = low["norm_latency_s_p90"] < high["norm_latency_s_p90"]
    assert f"first ({again[-1]}): {halfway if rising else 'never reached'}" in said
    assert main(["bench", "--bound", "0.04"]) == 2  # a bound reads sweeps: no load runs


def test_served_at_a_bound_is_read_between_the_rates_around_it() -> None:
    runs = [
        {"turns_per_s": 20.0, "norm_latency_s_p90": 0.03},
        {"turns_per_s": 10.0, "norm_latency_s_p90": 0.01},
        {"turns_per_s": 30.0, "norm_latency_s_p90": 0.07},
    ]
    assert served_at_bound(runs, 0.04) == pytest.approx(22.5)
    assert served_at_bound(runs, 0.01) == pytest.approx(10.0)
    assert served_at_bound(runs, 0.005) is None  # the lightest load is already past it
    assert served_at_bound(runs, 0.08) is None  # never reached in the sweep


async def bad_turn(url: str) -> dict[str, Any]:
    client = OpenAIChatClient(url, "EMPTY")
    try:
        return [m async for m in client.turn({"message": "Hi", "max_tokens": -1}, 30)][-1]
    finally:
        await client.close()


def test_bench_drives_the_openai_api_and_reports_what_the_server_counted(
    smollm2, smollm2_chat, sharegpt20, tmp_path, capsys
) -> None:
    """`pensieve bench --http`: the same conversations over the OpenAI API, measured and
    reported as over NATS; what it reports is what the server's metrics counted."""
    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    data_dir, port = tmp_path / "data", free_port()
    http = HttpConfig(port, model="smollm2")
    metrics = f"http://127.0.0.1:{port}/metrics"
    with EmbeddedNats() as server, serve_on_thread(built, data_dir, server.url, http=http):
        before = scrape(metrics)
        run = [
            "bench",
            "--http",
            f"http://127.0.0.1:{port}",
            str(sharegpt20),
            "--num-conversations",
            "3",
            "--max-turns",
            "2",
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--concurrency",
            "2",
            "--label",
            "http",
            "--json",
            str(tmp_path / "http.json"),
        ]
        assert main(run) == 0
        after = scrape(metrics)
        refused = asyncio.run(bad_turn(f"http://127.0.0.1:{port}/v1"))
    assert "http c=2" in capsys.readouterr().out
    # an error answer reaches the load's summary with its code and message
    assert refused["error"]["code"] and "max_tokens" in refused["error"]["message"], refused
    (summary,) = json.loads((tmp_path / "http.json").read_text())["runs"]
    assert summary["turns"] == 6 and summary["output_tokens"] == 24 and not summary["errors"]
    assert summary["prompt_sources"]["gpu"] > 0
    assert 0 < summary["ttft_s_p50"] <= summary["latency_s_p50"]

    def moved(name: str) -> float:
        return value(after, name) - value(before, name)

    assert moved("prompt_tokens_total") == summary["prompt_tokens"]
    assert moved("generation_tokens_total") == 24


# `vllm bench serve`'s result fields (its JSON names), with the percentiles chosen below
VLLM_FIELDS = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    *(
        f"{stat}_{metric}_ms"
        for metric in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "std", "p50", "p99")
    ),
)
VLLM_LINES = (
    "Successful requests:",
    "Failed requests:",
    "Maximum request concurrency:",
    "Benchmark duration (s):",
    "Total input tokens:",
    "Total generated tokens:",
    "Request throughput (req/s):",
    "Request goodput (req/s):",
    "Output token throughput (tok/s):",
    "Peak output token throughput (tok/s):",
    "Peak concurrent requests:",
    "Total Token throughput (tok/s):",
    *(
        f"{stat} {metric} (ms):"
        for metric in ("TTFT", "TPOT", "ITL", "E2EL")
        for stat in ("Mean", "Median", "P50", "P99")
    ),
)


def strict(text: str) -> Any:
    """JSON as a strict parser reads it: NaN and infinities refused."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_bench_reports_what_vllm_bench_serve_reports_and_plots_a_closed_loop(
    smollm2, smollm2_chat, sharegpt20, tmp_path, capsys
) -> None:
    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    work = [str(sharegpt20), "--num-conversations", "3", "--max-turns", "2"]
    work += ["--max-tokens", "4", "--ignore-eos", "--metric-percentiles", "50,99"]
    with EmbeddedNats() as server, serve_on_thread(built, tmp_path / "data", server.url):
        url = ["--nats-url", server.url]
        closed = [*url, *work, "--concurrency", "1,2", "--goodput", "ttft:60000", "tpot:60000"]
        closed += ["--json", str(tmp_path / "closed.json"), "--plot", str(tmp_path / "c.png")]
        assert main(["bench", *closed]) == 0
        out = capsys.readouterr().out
        # a closed-loop plot beside rate runs has no common axis: said before anything runs
        rates = [*url, *work, "--rates", "4", "--json", str(tmp_path / "rates.json")]
        assert main(["bench", *rates]) == 0
        mixed = [*closed[:-4], "--plot", str(tmp_path / "m.png")]
        mixed += ["--compare", str(tmp_path / "rates.json")]
        assert main(["bench", *mixed]) == 2
        assert "no common x axis" in capsys.readouterr().err
        assert not (tmp_path / "m.png").exists()
    for line in VLLM_LINES:
        assert out.count(line) == 2, line  # one block per run
    assert "turn 1 (3 requests)" in out  # the multi-turn load, by turn index
    runs = strict((tmp_path / "closed.json").read_text())["runs"]
    assert [r["concurrency"] for r in runs] == [1, 2]
    for run in runs:
        missing = [name for name in VLLM_FIELDS if name not in run]
        assert not missing, missing
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["total_output_tokens"] == 24
        assert run["request_goodput"] == run["request_throughput"]  # every request within
        assert run["mean_ttft_ms"] > 0 and run["p99_e2el_ms"] >= run["median_e2el_ms"] > 0
        assert run["mean_tpot_ms"] > 0 and run["mean_itl_ms"] > 0
        assert [t["turn"] for t in run["per_turn"]] == [0, 1]
        assert [t["completed"] for t in run["per_turn"]] == [3, 3]
    (rate_run,) = strict((tmp_path / "rates.json").read_text())["runs"]
    assert rate_run["request_goodput"] is None  # no --goodput: null, as vLLM writes it

    from matplotlib import image

    picture = image.imread(tmp_path / "c.png")
    height, width = picture.shape[:2]
    for panel in (picture[: int(height * 0.85), : width // 2], picture[:, width // 2 :]):
        assert coloured(panel, FIRST).sum() > 80  # both concurrencies drawn in each panel


def test_a_bench_with_nothing_measured_writes_null_never_nan(tmp_path) -> None:
    """A run whose every turn was refused: a summary of nothing, which a strict JSON parser
    reads."""
    from pensieve.ops.load import _summary, _Turns
    from pensieve.ops.load_report import Report
    from pensieve.ops.sweep import write_json

    empty = _Turns()
    empty.errors["invalid_request"] += 3
    write_json(tmp_path / "none.json", {"runs": [_summary(empty, 0.5, Report())]})
    (run,) = strict((tmp_path / "none.json").read_text())["runs"]
    assert run["completed"] == 0 and run["failed"] == 3
    assert run["mean_ttft_ms"] is None and run["ttft_s_p50"] is None


def test_plot_without_matplotlib_says_how_to_install_it_before_the_run(
    tmp_path, capsys, monkeypatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    nobody = f"nats://127.0.0.1:{free_port()}"  # nothing listens: the check comes first
    plot = ["--plot", str(tmp_path / "p.png")]
    assert main(["bench", "--nats-url", nobody, "--concurrency", "2", *plot]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert main(["bench", "agentic", "--nats-url", nobody, *plot]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
