"""`pensieve serve`: the chat API on NATS, every actor in this process.

Starts a nats-server on loopback unless `--nats-url` names one, opens the LMDB store in
`--data-dir`, and answers `pensieve.v1.chat` and `pensieve.v1.conversations.*` until SIGINT or
SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from pensieve.actors import subjects
from pensieve.actors.bus import Bus
from pensieve.actors.chat_service import ChatService
from pensieve.actors.server import ChatServer, EngineThread
from pensieve.ops.factory import Built
from pensieve.ops.nats_server import EmbeddedNats
from pensieve.store import ConversationStore, StoreWriter


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "pensieve"


@contextlib.asynccontextmanager
async def serving(
    built: Built, store: ConversationStore, nats_url: str, max_waiting: int = 1024
) -> AsyncIterator[ChatService]:
    """Serve the client API on `nats_url` while the context is open."""
    store.clear_spills()  # the CPU tier does not survive a restart
    with StoreWriter() as writer:
        engine_id = store.engine_id()

        def new_id() -> str:  # names this engine, so other engines forward its turns here
            return subjects.new_conversation_id(engine_id, secrets.token_hex(8))

        service = ChatService(built.engine, built.chat, built.loaded.config.max_context_len,
                              store, writer, max_waiting, new_id)  # fmt: skip
        on_cpu = built.engine.runner.device.type == "cpu"  # leave a core to the serving layer
        engine = EngineThread(service, max(1, (os.cpu_count() or 1) - 1) if on_cpu else None)
        try:
            bus = await Bus.connect(nats_url)
            server = ChatServer(bus, engine, engine_id)
            try:
                await server.start()
                yield service
            finally:
                await bus.close()
                server.close()
        finally:
            engine.stop()


async def _serve_until_signal(
    built: Built, store: ConversationStore, url: str, waiting: int
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with serving(built, store, url, waiting):
        own = subjects.engine_subject(store.engine_id(), ">")
        print(f"pensieve: serving on {url} (pensieve.v1.chat, pensieve.v1.conversations.*; "
              f"this engine: {own})", file=sys.stderr, flush=True)  # fmt: skip
        await stop.wait()


def run(built: Built, data_dir: Path, nats_url: str | None, max_waiting: int) -> int:
    data_dir.mkdir(parents=True, exist_ok=True)
    with ConversationStore(data_dir) as store, contextlib.ExitStack() as stack:
        if nats_url is None:
            nats_url = stack.enter_context(EmbeddedNats()).url
        asyncio.run(_serve_until_signal(built, store, nats_url, max_waiting))
    return 0
