"""Bad input to `pensieve replay`: one clear line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest


def replay(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pensieve.ops.cli", "replay", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def assert_clean_error(done: subprocess.CompletedProcess[str], words: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("pensieve: error:")]
    assert len(lines) == 1 and words in lines[0], done.stderr


def test_missing_file(tmp_path):
    done = replay(str(tmp_path / "nope.json"), "--model", "preset:tiny-llama", "--out", "-")
    assert_clean_error(done, "nope.json")


def test_malformed_records(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "conversations": "not a list"}\n')
    done = replay(str(bad), "--model", "preset:tiny-llama", "--out", "-")
    assert_clean_error(done, "bad.jsonl")


def test_unknown_model(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_bytes(orjson.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"}]}))
    done = replay(str(good), "--model", "no-such-model", "--out", "-")
    assert_clean_error(done, "no-such-model")


@pytest.mark.slow
def test_context_longer_than_the_model_allows(tmp_path):
    long = tmp_path / "long.jsonl"
    message = "word " * 3000  # tiny-llama allows 1024 positions
    long.write_bytes(
        orjson.dumps({"id": "a", "conversations": [{"from": "human", "value": message}]})
    )
    done = replay(str(long), "--model", "preset:tiny-llama", "--out", str(tmp_path / "o.jsonl"))
    assert_clean_error(done, "exceeds the model's context")
