"""`pensieve chat`: talk to a running server from a terminal, over NATS, or (`--http`) over the
OpenAI API of any server that has one.

Each line typed is the next message of one conversation (with readline's line editing and
history), and the reply streams in as the engine generates it; a line under it says where the
prompt's KV came from. Ctrl-C stops the reply being streamed (the server is told to cancel the
turn) and the conversation goes on. Commands: `/new` starts another conversation, `/history`
shows this one's turns, `/stats` the engine's state, `/quit` (or the end of input) leaves.
`--message TEXT` (`-` for standard input) sends one message, prints the reply and exits. Over
HTTP the client keeps the chat and resends it every turn, as OpenAI's API has it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import orjson

from pensieve.actors.config import DEFAULTS
from pensieve.actors.wire import subjects
from pensieve.actors.wire.bus import Bus, ConnectOptions
from pensieve.ops.load import ChatClient, NatsClient

HELP = "/new: another conversation   /history: its turns   /stats: the engine   /quit: leave"
Reader = Callable[[str], Awaitable[str | None]]  # a prompt -> the line typed (None: no more)


@dataclass(frozen=True)
class ChatOptions:
    url: str
    connect: ConnectOptions | None = None
    max_tokens: int = DEFAULTS.max_tokens
    temperature: float = 0.0
    timeout_s: float = 300.0  # silence after which a reply is given up
    system: str | None = None  # the system message each conversation starts with
    message: str | None = None  # one message to send; its reply printed alone (None: a session)
    http: str | None = None  # the OpenAI API's URL, instead of NATS
    api_key: str = "EMPTY"
    model: str | None = None  # over HTTP (None: the first the server lists)


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
    """One terminal's conversation with the server: what it sends and what it prints. `client`
    sends the turns (`ops/load.py`'s `ChatClient`); `bus` answers /history and /stats (None:
    over HTTP, none)."""

    def __init__(
        self, client: ChatClient, options: ChatOptions, out: TextIO, bus: Bus | None = None
    ) -> None:
        self.client = client
        self.bus = bus
        self.options = options
        self.out = out
        self.conversation_id: str | None = None
        self.chat: list[dict[str, str]] = []  # over HTTP: the chat so far, resent every turn
        self.replying: asyncio.Task[None] | None = None  # the turn streaming in
        self.stopped = False  # Ctrl-C stopped the turn streaming in; its end is awaited
        self._cancelling: asyncio.Future[None] | None = None  # the cancel asked of the server

    async def run(self, read: Reader) -> None:
        self.say(HELP)
        while (line := await read("> ")) is not None:
            line = line.strip()
            if line == "/quit":
                return
            if line == "/new":
                self.conversation_id, self.chat = None, []
                self.say("(a new conversation)")
            elif line in ("/history", "/stats") and self.bus is None:
                self.say(f"({line} asks the engine over NATS; this chat is over HTTP)")
            elif line == "/history":
                await self.history()
            elif line == "/stats":
                await self.stats()
            elif line.startswith("/"):
                self.say(f"unknown command {line!r}; {HELP}")
            elif line:
                await self.reply_to(line)

    async def reply_to(self, message: str) -> None:
        """One turn, stopped by `interrupt` (Ctrl-C): the turn is cancelled on the server, and
        the conversation goes on with what it kept."""
        self.stopped = False
        self.replying = asyncio.ensure_future(self.turn(message))
        try:
            await self.replying
        except asyncio.CancelledError:
            if not self.replying.cancelled():
                raise  # this task itself is being cancelled
            self.say("\n[stopped]")
            await self.cancel_on_server()
        except (ConnectionError, TimeoutError) as error:  # the server is away
            self.say(f"\n[{error}]")
        finally:
            self.replying = None

    def interrupt(self) -> bool:
        """Ctrl-C: stop the reply streaming in (False: none is). Over NATS the server is asked
        to cancel the turn, and the stream is read to its final message, which comes once the
        stopped turn is committed, so the next message never finds it in progress."""
        if self.replying is None or self.replying.done():
            return False
        if self.bus is None or self.conversation_id is None or self.stopped:
            self.replying.cancel()  # over HTTP, or before the id: closing the stream ends it
        else:
            self.stopped = True
            self._cancelling = asyncio.ensure_future(self.cancel_on_server())
        return True

    async def cancel_on_server(self) -> None:
        if self.bus is None or self.conversation_id is None:
            return  # over HTTP, the closed stream ends the turn
        body = orjson.dumps({"conversation_id": self.conversation_id})
        with contextlib.suppress(ConnectionError, TimeoutError, StopAsyncIteration):
            async with contextlib.aclosing(self.bus.ask(subjects.CHAT_CANCEL, body, 10)) as a:
                await anext(a)

    async def turn(self, message: str) -> None:
        options = self.options
        body: dict[str, Any] = {
            "max_tokens": options.max_tokens,
            "temperature": options.temperature,
            "stream": True,
        }
        system = [{"role": "system", "content": options.system}] if options.system else []
        if self.bus is None:  # the OpenAI API: the whole chat, every turn
            self.chat = self.chat or system
            body["messages"] = [*self.chat, {"role": "user", "content": message}]
        elif self.conversation_id is not None:
            body |= {"conversation_id": self.conversation_id, "message": message}
        elif system:
            body["messages"] = [*system, {"role": "user", "content": message}]
        else:
            body["message"] = message
        text: list[str] = []
        async with contextlib.aclosing(self.client.turn(body, options.timeout_s)) as answer:
            async for reply in answer:
                if "error" in reply:
                    self.say(f"\n[error {reply['error']['code']}: {reply['error']['message']}]")
                    return
                if "delta" in reply:
                    self.conversation_id = reply.get("conversation_id") or self.conversation_id
                    text.append(reply["delta"])
                    if not self.stopped:
                        self.out.write(reply["delta"])
                        self.out.flush()
                    continue
                self.conversation_id = reply.get("conversation_id") or self.conversation_id
                if self.stopped:  # the stopped turn is committed: the session goes on
                    self.say("\n[stopped]")
                    return
                if self.bus is None:
                    self.chat = [
                        *body["messages"],
                        {"role": "assistant", "content": "".join(text)},
                    ]
                if options.message is None:  # a session: where the prompt's KV came from
                    self.say("\n" + _turn_line(reply, self.conversation_id))
                else:
                    self.say("")
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
        assert self.bus is not None  # over NATS
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
    """A line from standard input, off the event loop (None at the end of input), with
    readline's line editing and history where the terminal has them."""
    with contextlib.suppress(ImportError):  # not on every platform
        import readline  # noqa: F401  (input() edits lines and recalls them once imported)

    def read() -> str | None:
        try:
            return input(prompt)
        except EOFError:
            return None

    return await asyncio.to_thread(read)


def _turn_line(reply: dict[str, Any], conversation_id: str | None) -> str:
    """The line under a reply: its tokens, and where the prompt's KV came from."""
    usage = reply["usage"]
    sources = usage["prompt_sources"]
    where = "" if conversation_id is None else f" of {conversation_id}"
    turn = f"turn {reply['turn']}{where}" if "turn" in reply else f"reply{where}"
    tail = f", {reply['finish_reason']}" if "finish_reason" in reply else ""
    return (
        f"[{turn}: {usage['prompt_tokens']} prompt tokens, {usage['cached_tokens']} cached "
        f"(gpu {sources['gpu']}, cpu {sources['cpu']}, disk {sources['disk']}; recomputed "
        f"{sources['recomputed']}, new {sources['new']}), "
        f"{usage['completion_tokens']} completion tokens{tail}]"
    )


async def connect_client(url: str, name: str, connect: ConnectOptions | None) -> Bus:
    """A client command's connection: OSError if no server answers within 10 s, and the
    bus's AuthorizationRefused (a PermissionError) at once if it refuses the credentials."""
    try:
        return await asyncio.wait_for(Bus.connect(url, name=name, options=connect), 10)
    except TimeoutError:
        raise OSError(f"no NATS server answers at {url} (within 10 s)") from None


async def chat(options: ChatOptions, read: Reader = read_terminal, out: TextIO = sys.stdout) -> int:
    """Talk to the server until `/quit` or the end of input, or send `options.message` alone."""
    async with contextlib.AsyncExitStack() as stack:
        bus = None
        if options.http is None:
            bus = await connect_client(options.url, "pensieve-chat", options.connect)
            stack.push_async_callback(bus.close)
            client: ChatClient = NatsClient(bus)
        else:
            from pensieve.ops.openai_client import OpenAIChatClient, base_url

            http = OpenAIChatClient(base_url(options.http), options.api_key, options.model)
            stack.push_async_callback(http.close)
            await http.served_model()  # fails here if nothing answers
            client = http
        session = ChatSession(client, options, out, bus)
        if options.message is not None:
            await session.turn(options.message)
            return 0
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError):  # no signal handlers on Windows' loop
            loop.add_signal_handler(signal.SIGINT, _interrupt, session, out)
            stack.callback(loop.remove_signal_handler, signal.SIGINT)
        await session.run(read)
    return 0


def _interrupt(session: ChatSession, out: TextIO) -> None:
    """Ctrl-C: stops the reply streaming in; at the prompt, says how to leave."""
    if not session.interrupt():
        out.write("\n(/quit or Ctrl-D leaves)\n> ")
        out.flush()


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
    parser.add_argument(
        "--http",
        metavar="URL",
        help="talk to the OpenAI API at URL (http://HOST:PORT/v1) of any server instead of NATS,"
        " with the --tenant file's key, else $OPENAI_API_KEY (default: NATS)",
    )
    parser.add_argument(
        "--model",
        metavar="NAME",
        help="with --http: the model to ask for (default: the first the server lists)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULTS.max_tokens,
        metavar="N",
        help="tokens per reply at most",
    )
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy")
    parser.add_argument(
        "--system",
        metavar="TEXT",
        help="the system message each conversation starts with (default: none)",
    )
    parser.add_argument(
        "-m",
        "--message",
        metavar="TEXT",
        help="send TEXT ('-': standard input) as one message, print the reply and exit "
        "(default: a session, a message a line)",
    )
