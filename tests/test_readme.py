"""The README's commands and examples work as written, and the tree speaks of the product only.

The client example runs verbatim against `pensieve serve` started exactly as the README starts it
(its data directory moved under tmp_path through XDG_DATA_HOME); the README's blocks are read
with the same script CI reads the test command with.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pensieve.actors.config import DEFAULTS
from pensieve.ops.nats_server import check_port_free

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_block", ROOT / ".ci" / "readme_block.py")
assert _spec is not None and _spec.loader is not None
_readme = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_readme)
readme_block = _readme.readme_block

NARRATION = re.compile(r"\bsession \d+|\bcall \d+\b|diag_s\d+|ops/results", re.IGNORECASE)


def _command(line: str) -> list[str]:
    """A README command line, with `pensieve` resolved to this environment's script."""
    words = shlex.split(line.split("#")[0])
    assert words[0] == "pensieve", line
    script = shutil.which("pensieve") or str(Path(sys.executable).parent / "pensieve")
    return [script, *words[1:]]


class _Lines:
    """Collects a process's stderr lines on a thread of its own, so its pipe never fills."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, proc: subprocess.Popen[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} from the server:\n" + "".join(self.lines))
            time.sleep(0.1)

    @property
    def text(self) -> str:
        return "".join(self.lines)


def _client(language: str, folder: Path) -> list[str]:
    """The README's client example of `language`, written into `folder`: the command that runs it
    (skips where Node.js or its NATS client cannot be had)."""
    if language == "python":
        example = folder / "example.py"
        example.write_text(readme_block("client example"))
        return [sys.executable, str(example)]
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("no Node.js here")
    installed = subprocess.run(
        [
            npm,
            "install",
            "--no-audit",
            "--no-fund",
            "--prefix",
            str(folder),
            "@nats-io/transport-node@3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if installed.returncode != 0:
        pytest.skip(f"the Node NATS client could not be installed: {installed.stderr[-300:]}")
    (folder / "client.mjs").write_text(readme_block("node client example"))
    return [node, "client.mjs"]


@pytest.mark.slow
@pytest.mark.parametrize("language", ["python", "node"])
def test_the_client_example_runs_verbatim_against_serve_started_as_the_readme_says(
    tmp_path: Path, language: str
) -> None:
    try:
        check_port_free(DEFAULTS.nats_port)
    except OSError as busy:  # the README's server needs the default port
        pytest.skip(str(busy))
    client = _client(language, tmp_path)
    (serve_line,) = readme_block("serve command").splitlines()
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        _command(serve_line), stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path
    )
    log = _Lines(proc)
    try:
        log.wait_for("serving on nats://127.0.0.1:4222", proc, timeout_s=240)
        (tenant_line,) = readme_block("tenant command").splitlines()
        words = _command(tenant_line)
        subprocess.run(words, env=env, cwd=tmp_path, timeout=120, check=True)
        written = tmp_path / words[words.index("--out") + 1]
        assert written.stat().st_mode & 0o077 == 0  # the tenant's secrets: this user's alone
        done = subprocess.run(client, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        *texts, cached_line = done.stdout.strip().splitlines()
        assert len(texts) >= 2 and all(line.strip() for line in (texts[0], texts[-1]))
        cached = ast.literal_eval(cached_line.removeprefix("cached prompt tokens:").strip())
        assert type(cached) is int and cached > 0  # the second turn reused the first's KV
        log.wait_for("turn 1 of", proc, timeout_s=30)  # one log line per finished turn
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for phase in (
        "nats-server listening on",
        "model smollm2 loaded in",
        "tokenizer ready in",
        "engine ready in",
        "ready in",
        "turn 0 of",
    ):
        assert phase in log.text, log.text
    data_dir = tmp_path / "data" / "pensieve"  # the README's default data directory
    assert data_dir.is_dir() and data_dir.stat().st_mode & 0o077 == 0  # this user's alone


def test_the_readme_is_short_and_links_only_to_what_exists() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), target
    for name in (
        "run command",
        "test command",
        "serve command",
        "tenant command",
        "client example",
        "node client example",
    ):
        assert readme_block(name).strip()


def test_the_readme_hands_secrets_over_in_files_and_pipes_only() -> None:
    """The tenant's line goes into a file of mode 0600, and `docker compose exec` runs without
    a terminal (-T) where its output is redirected: a pseudo-terminal would end each line in
    \\r\\n and mix the command's stderr into the file."""
    assert "--out" in readme_block("tenant command")
    text = (ROOT / "README.md").read_text()
    execs = re.findall(r"docker compose exec\b[^\n]*", text)
    assert execs and all(re.match(r"docker compose exec -T\b", line) for line in execs), execs


def test_the_tracked_tree_speaks_of_the_product_only() -> None:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run([git, "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    files = [name for name in listed.stdout.decode().split("\0") if name]
    assert not [name for name in files if name.startswith("ops/results/")]
    found = []
    for name in files:
        path = ROOT / name
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if NARRATION.search(line) and name != "tests/test_readme.py":
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_readme_says_when_a_request_is_traced() -> None:
    """Tracing is on with `--trace`, which every actor of the compose stack gets."""
    import yaml

    said = " ".join((ROOT / "README.md").read_text().split())
    (sentence,) = [s for s in said.split(". ") if "traced" in s]
    assert "--trace otlp" in sentence and "compose" in sentence, sentence
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    actors = [s for s in services.values() if str(s.get("command", "")).startswith("actor")]
    assert actors and all("--trace otlp" in s["command"] for s in actors)
