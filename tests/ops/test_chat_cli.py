"""`pensieve chat` driven through a pseudo-terminal against a real server (a real nats-server,
the real SmolLM2): two turns of one conversation stream in, the second served from the KV the
first left, and the commands show the conversation's history and the engine's state."""

from __future__ import annotations

import fcntl
import os
import re
import select
import subprocess
import sys
import termios
import time

import pytest

from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
from pensieve.ops.nats_server import EmbeddedNats
from tests.ops.serving import serve_on_thread

pytestmark = pytest.mark.slow

TURN_LINE = re.compile(
    r"\[turn (\d+) of (\S+): (\d+) prompt tokens, (\d+) cached \(gpu (\d+), cpu (\d+), "
    r"disk (\d+); recomputed (\d+), new (\d+)\), (\d+) completion tokens, (\w+)\]"
)


class Terminal:
    """A process on the slave side of a pseudo-terminal, its controlling terminal (so that
    Ctrl-C typed there interrupts it); what it prints is read as a user sees it (with the
    terminal's \\r\\n turned back into \\n)."""

    def __init__(self, command: list[str]) -> None:
        self.master, slave = os.openpty()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TERM": "xterm"}
        self.proc = subprocess.Popen(
            command,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            close_fds=True,
            start_new_session=True,  # then the terminal becomes its session's
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
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
            # cached: the tokens of the reused tiers; with recomputed and new, the whole prompt
            cached, gpu, cpu, disk, recomputed, new = map(int, second.group(4, 5, 6, 7, 8, 9))
            assert cached == gpu + cpu + disk and cached + recomputed + new == int(second[3])
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


def test_ctrl_c_stops_a_reply_and_the_session_goes_on_with_its_history(
    smollm2, smollm2_chat, tmp_path
) -> None:
    """Ctrl-C while a reply streams stops it and keeps the conversation; the up arrow recalls
    the line typed before (readline); --system opens the conversation."""
    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    with EmbeddedNats() as server, serve_on_thread(built, tmp_path, server.url) as (_, service):
        command = [sys.executable, "-m", "pensieve.ops.cli", "chat", "--nats-url", server.url]
        command += ["--max-tokens", "48", "--system", "You are a pirate."]
        terminal = Terminal(command)
        try:
            terminal.read_until("> ")
            terminal.type("Tell me a very long story about the sea.")
            terminal.read_until("sea.\n")
            terminal.read_until(" ")  # the reply streams in
            os.write(terminal.master, b"\x03")  # Ctrl-C, as the terminal sends it
            stopped = terminal.read_until("> ")
            assert "[stopped]" in stopped and not TURN_LINE.search(stopped), stopped
            assert terminal.proc.poll() is None  # still there
            os.write(terminal.master, b"\x1b[A")  # the up arrow: the line before, again
            assert "a very long story" in terminal.read_until("sea.")
            os.write(terminal.master, b"\x15")  # Ctrl-U: erase it, then a short one
            terminal.type("Say hi.")
            printed = terminal.read_until("> ")
            found = TURN_LINE.search(printed)
            assert found is not None, printed
            conv_id = found.group(2)
            stored = service.get(conv_id)
            (system,) = stored.turns[0].history or []
            assert (system.role, system.content) == ("system", "You are a pirate.")
            assert [t.message for t in stored.turns][-1] == "Say hi."
            assert len(stored.turns) == 2  # the stopped turn, then this one: one conversation
            assert stored.turns[0].finish_reason == "cancelled"
            assert int(found.group(1)) == 1
            terminal.type("/quit")
            assert terminal.proc.wait(30) == 0
        finally:
            if terminal.proc.poll() is None:
                terminal.proc.kill()
            os.close(terminal.master)


def test_one_message_over_nats_or_http_prints_its_reply_alone(
    smollm2, smollm2_chat, tmp_path
) -> None:
    from pensieve.actors.ingress.http_actor import HttpConfig
    from pensieve.ops.nats_server import free_port

    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    port = free_port()
    http = HttpConfig(port, model="smollm2")
    with EmbeddedNats() as server, serve_on_thread(built, tmp_path, server.url, http=http):
        chat = [sys.executable, "-m", "pensieve.ops.cli", "chat", "--max-tokens", "8"]
        replies = []
        for way, stdin in (
            (["--nats-url", server.url, "-m", "What is the capital of France?"], None),
            (["--nats-url", server.url, "-m", "-"], "What is the capital of France?"),
            (["--http", f"http://127.0.0.1:{port}", "-m", "What is the capital of France?"], None),
        ):
            done = subprocess.run(
                [*chat, *way], input=stdin or "", capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, done.stderr
            assert "> " not in done.stdout and "/quit" not in done.stdout
            replies.append(done.stdout.strip())
        # greedy: the same reply each way
        assert replies[0] and replies == [replies[0]] * 3, replies
