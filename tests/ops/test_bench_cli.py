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
from pensieve.ops.factory import EngineOptions, assemble
from pensieve.ops.nats_server import EmbeddedNats, free_port
from pensieve.ops.openai_client import OpenAIChatClient
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
        assert run["cached_tokens"]["gpu"] > 0  # second turns came from the KV the first left
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
    assert summary["cached_tokens"]["gpu"] > 0
    assert 0 < summary["ttft_s_p50"] <= summary["latency_s_p50"]

    def moved(name: str) -> float:
        return value(after, name) - value(before, name)

    assert moved("prompt_tokens_total") == summary["prompt_tokens"]
    assert moved("generation_tokens_total") == 24
