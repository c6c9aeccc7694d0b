"""`pensieve chat` driven through a pseudo-terminal against a real server (a real nats-server,
the real SmolLM2): two turns of one conversation stream in, the second served from the KV the
first left, and the commands show the conversation's history and the engine's state."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time

import pytest

from pensieve.ops.factory import EngineOptions, assemble
from pensieve.ops.nats_server import EmbeddedNats
from tests.ops.serving import serve_on_thread

pytestmark = pytest.mark.slow

TURN_LINE = re.compile(
    r"\[turn (\d+) of (\S+): (\d+) prompt tokens \(gpu (\d+), cpu (\d+), "
    r"recomputed (\d+)\), (\d+) completion tokens, (\w+)\]"
)


class Terminal:
    """A process on the slave side of a pseudo-terminal; what it prints is read as a user sees
    it (with the terminal's \\r\\n turned back into \\n)."""

    def __init__(self, command: list[str]) -> None:
        self.master, slave = os.openpty()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            command, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True
        )
        os.close(slave)
        self.seen = ""

    def read_until(self, pattern: str, timeout: float = 120.0) -> str:
        """Everything printed since the last call, up to and including `pattern`."""
        deadline = time.monotonic() + timeout
        while pattern not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in:\n{self.seen}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    data = os.read(self.master, 4096)
                except OSError:  # the process is gone
                    data = b""
                assert data, f"the chat ended before {pattern!r}:\n{self.seen}"
                self.seen += data.decode(errors="replace").replace("\r\n", "\n")
        end = self.seen.index(pattern) + len(pattern)
        text, self.seen = self.seen[:end], self.seen[end:]
        return text

    def type(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())


def test_two_turns_through_a_terminal(smollm2, smollm2_chat, tmp_path) -> None:
    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    with EmbeddedNats() as server, serve_on_thread(built, tmp_path, server.url) as (_, service):
        command = [
            sys.executable,
            "-m",
            "pensieve.ops.cli",
            "chat",
            "--nats-url",
            server.url,
            "--max-tokens",
            "12",
        ]
        terminal = Terminal(command)
        try:
            terminal.read_until("> ")
            replies = []
            for message in ("What is the capital of France?", "And of Italy?"):
                terminal.type(message)
                printed = terminal.read_until("> ")
                found = TURN_LINE.search(printed)
                assert found is not None, printed
                # what streamed in, between the echoed message and the turn's line
                streamed = printed[printed.index(message) + len(message) + 1 : found.start() - 1]
                replies.append((found, streamed))
            (first, _), (second, _) = replies
            conv_id = first.group(2)
            assert second.group(2) == conv_id and [first[1], second[1]] == ["0", "1"]
            assert int(second.group(4)) > 0  # the second prompt's history was on the GPU
            stored = service.get(conv_id).turns
            assert [streamed for _, streamed in replies] == [t.text for t in stored]
            terminal.type("/history")
            history = terminal.read_until("> ")
            assert "you: What is the capital of France?" in history and "And of Italy?" in history
            terminal.type("/stats")
            assert re.search(r"engine \S+ \(pensieve\): 0 running", terminal.read_until("> "))
            terminal.type("/quit")
            assert terminal.proc.wait(30) == 0
        finally:
            if terminal.proc.poll() is None:
                terminal.proc.kill()
            os.close(terminal.master)
