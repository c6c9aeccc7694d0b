"""`pensieve chat`: talk to a running server from a terminal, over NATS.

Each line typed is the next message of one conversation, and the reply streams in as the engine
generates it; a line under it says where the prompt's KV came from. Commands: `/new` starts
another conversation, `/history` shows this one's turns, `/stats` the engine's state, `/quit`
(or the end of input) leaves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import orjson

from pensieve.actors.config import DEFAULTS
from pensieve.actors.wire import subjects
from pensieve.actors.wire.bus import Bus, ConnectOptions

HELP = "/new: another conversation   /history: its turns   /stats: the engine   /quit: leave"
Reader = Callable[[str], Awaitable[str | None]]  # a prompt -> the line typed (None: no more)


@dataclass(frozen=True)
class ChatOptions:
    url: str
    connect: ConnectOptions | None = None
    max_tokens: int = DEFAULTS.max_tokens
    temperature: float = 0.0
    timeout_s: float = 300.0  # silence after which a reply is given up


def tenant_options(path: Path) -> tuple[str, ConnectOptions]:
    """The server and credentials in a line printed by `pensieve tenant add`."""
    try:
        line = json.loads(path.read_text())
        nats = line["nats"]
        seed = nats.get("nkeys_seed_str")  # a tenant with an nkey; else one with a password
        options = ConnectOptions(
            user=None if seed else nats["user"],
            password=None if seed else nats["password"],
            nkeys_seed_str=seed,
            inbox_prefix=nats["inbox_prefix"],
        )
        return nats["servers"][0], options
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise ValueError(f"{path} is not a line of `pensieve tenant add` ({error!r})") from None


class ChatSession:
    """One terminal's conversation with the server: what it sends and what it prints."""

    def __init__(self, bus: Bus, options: ChatOptions, out: TextIO) -> None:
        self.bus = bus
        self.options = options
        self.out = out
        self.conversation_id: str | None = None

    async def run(self, read: Reader) -> None:
        self.say(HELP)
        while (line := await read("> ")) is not None:
            line = line.strip()
            if line == "/quit":
                return
            if line == "/new":
                self.conversation_id = None
                self.say("(a new conversation)")
            elif line == "/history":
                await self.history()
            elif line == "/stats":
                await self.stats()
            elif line.startswith("/"):
                self.say(f"unknown command {line!r}; {HELP}")
            elif line:
                try:
                    await self.turn(line)
                except (ConnectionError, TimeoutError) as error:  # the server is away
                    self.say(f"\n[{error}]")

    async def turn(self, message: str) -> None:
        options = self.options
        body: dict[str, Any] = {
            "message": message,
            "max_tokens": options.max_tokens,
            "temperature": options.temperature,
            "stream": True,
        }
        if self.conversation_id is not None:
            body["conversation_id"] = self.conversation_id
        answer = self.bus.ask(subjects.CHAT, orjson.dumps(body), self.options.timeout_s)
        async with contextlib.aclosing(answer) as messages:
            async for data in messages:
                reply = orjson.loads(data)
                if "error" in reply:
                    self.say(f"\n[error {reply['error']['code']}: {reply['error']['message']}]")
                    return
                if not reply.get("done"):
                    self.out.write(reply["delta"])
                    self.out.flush()
                    continue
                self.conversation_id = reply["conversation_id"]
                usage = reply["usage"]
                cached = usage["cached_tokens"]
                self.say(
                    f"\n[turn {reply['turn']} of {self.conversation_id}: "
                    f"{usage['prompt_tokens']} prompt tokens (gpu {cached['gpu']}, cpu "
                    f"{cached['cpu']}, recomputed {cached['recomputed']}), "
                    f"{usage['completion_tokens']} completion tokens, "
                    f"{reply['finish_reason']}]"
                )
                return

    async def history(self) -> None:
        if self.conversation_id is None:
            self.say("(nothing said yet)")
            return
        cursor = None
        while True:
            body = {"conversation_id": self.conversation_id}
            if cursor is not None:
                body["cursor"] = cursor
            got = await self.ask(subjects.CONVERSATIONS_GET, body)
            for turn in got.get("turns", []):
                self.say(f"[{turn['turn']}] you: {turn['message']}\n    assistant: {turn['text']}")
            cursor = got.get("next_cursor")
            if cursor is None:
                return

    async def stats(self) -> None:
        got = await self.ask(subjects.STATS, {})
        if "requests" not in got:
            return
        requests, sources = got["requests"], got["tokens"]["prompt_sources"]
        cache = got["cache"]
        self.say(
            f"engine {got['engine_id']} ({got['policy']}): {requests['running']} running, "
            f"{requests['waiting']} waiting, {requests['finished']} finished\n"
            f"prompt tokens from gpu {sources['gpu']}, cpu {sources['cpu']}, recomputed "
            f"{sources['recomputed']}, new {sources['new']}\n"
            f"gpu blocks free {cache['gpu_blocks']['free']} of "
            f"{cache['gpu_blocks']['total']}, cpu blocks free "
            f"{cache['cpu_blocks']['free']} of {cache['cpu_blocks']['total']}"
        )

    async def ask(self, subject: str, body: dict[str, Any]) -> dict[str, Any]:
        """One answer to a request; an error is printed and comes back as it is."""
        answer = self.bus.ask(subject, orjson.dumps(body), self.options.timeout_s)
        async with contextlib.aclosing(answer) as messages:
            got: dict[str, Any] = orjson.loads(await anext(messages))
        if "error" in got:
            self.say(f"[error {got['error']['code']}: {got['error']['message']}]")
        return got

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


async def read_terminal(prompt: str) -> str | None:
    """A line from standard input, off the event loop (None at the end of input)."""

    def read() -> str | None:
        try:
            return input(prompt)
        except EOFError:
            return None

    return await asyncio.to_thread(read)


async def connect_client(url: str, name: str, connect: ConnectOptions | None) -> Bus:
    """A client command's connection: OSError if no server answers within 10 s, and the
    bus's AuthorizationRefused (a PermissionError) at once if it refuses the credentials."""
    try:
        return await asyncio.wait_for(Bus.connect(url, name=name, options=connect), 10)
    except TimeoutError:
        raise OSError(f"no NATS server answers at {url} (within 10 s)") from None


async def chat(options: ChatOptions, read: Reader = read_terminal, out: TextIO = sys.stdout) -> int:
    """Talk to the server at `options.url` until `/quit` or the end of input."""
    bus = await connect_client(options.url, "pensieve-chat", options.connect)
    try:
        await ChatSession(bus, options, out).run(read)
    finally:
        await bus.close()
    return 0


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """Where a client command connects: `--nats-url`, or a tenant's line (`--tenant`)."""
    parser.add_argument(
        "--nats-url",
        metavar="URL",
        help="the server's NATS (default: the tenant file's, else nats://127.0.0.1:4222)",
    )
    parser.add_argument(
        "--tenant",
        type=Path,
        metavar="FILE",
        help="connect as the tenant whose line `pensieve tenant add` printed into FILE",
    )


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    add_connection_args(parser)
    parser.add_argument("--max-tokens", type=int, default=DEFAULTS.max_tokens, metavar="N")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T")
