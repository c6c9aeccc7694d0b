"""Helpers of the end-to-end tests: a server on a thread of its own, and the stateless reference
that every reply is checked against."""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

from pensieve.actors.config import DEFAULTS, Policy, StepChannel
from pensieve.actors.ingress.http_actor import HttpConfig
from pensieve.actors.scheduler.chat_service import ChatService
from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.actors.wire.bus import ConnectOptions
from pensieve.models.loader import LoadedModel
from pensieve.ops.context import Context, Nats, ServeOptions
from pensieve.ops.deploy import deployment, serve_plan
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import Built, assemble
from pensieve.ops.replay import ReplayOptions, replay
from pensieve.ops.sharegpt import load_conversations
from pensieve.store import ConversationStore
from tests.event_loops import finish_tasks


def stateless_reference(
    model: LoadedModel, chat: ChatTokenizer, messages: Sequence[str], max_tokens: int, folder: Path
) -> list[list[int]]:
    """Greedy tokens of each turn of the chat `messages`, replayed in-process with the stateless
    policy and no cache limits."""
    return stateless_references(model, chat, [messages], max_tokens, folder)[0]


def stateless_references(
    model: LoadedModel,
    chat: ChatTokenizer,
    chats: Sequence[Sequence[str]],
    max_tokens: int,
    folder: Path,
) -> list[list[list[int]]]:
    """`stateless_reference` of several chats, replayed together."""
    path = folder / "chats.jsonl"
    with path.open("wb") as out:
        for i, messages in enumerate(chats):
            turns = [{"from": "human", "value": text} for text in messages]
            out.write(orjson.dumps({"id": f"ref{i}", "conversations": turns}) + b"\n")
    built = assemble(EngineOptions(model="smollm2", policy=Policy.STATELESS), model, chat)
    replies = io.BytesIO()
    replay(built, load_conversations(path), ReplayOptions(max_new_tokens=max_tokens), replies, None)
    tokens: list[list[list[int]]] = [[] for _ in chats]
    for line in replies.getvalue().splitlines():
        record = orjson.loads(line)
        chat_index = int(record["conversation_id"].removeprefix("ref"))
        tokens[chat_index].append(record["output_token_ids"])
    return tokens


@contextlib.contextmanager
def serve_on_thread(
    built: Built,
    data_dir: Path,
    url: str,
    max_waiting: int = DEFAULTS.max_waiting,
    shutdown_grace_s: float = DEFAULTS.shutdown_grace_s,
    step_channel: StepChannel = DEFAULTS.step_channel,
    connect: ConnectOptions | None = None,
    remote_text: bool | None = None,
    http: HttpConfig | None = None,
    metrics_port: int | None = None,
    events: ConnectOptions | None = None,
) -> Iterator[tuple[str, ChatService]]:
    """Every actor of `pensieve serve` (`serve_plan`) around `built` on `url`, from a thread
    with its own event loop; yields the engine id and the chat service, and checks on leaving
    that the server stopped cleanly. HTTP requests need no API key."""
    options = ServeOptions(
        data_dir,
        max_waiting=max_waiting,
        shutdown_grace_s=shutdown_grace_s,
        step_channel=step_channel,
        remote_text=remote_text,
        http=http,
        api_keys_required=False,
        metrics_port=metrics_port,
    )
    loop = asyncio.new_event_loop()
    ready, failed, held = threading.Event(), [], []
    stop = asyncio.Event()

    async def main() -> None:
        with ConversationStore(data_dir) as store:
            nats = Nats(url, connect, events)
            context = Context(nats, store, built.options, options, built=built)
            async with deployment(context, serve_plan(options)):
                server = context.scheduler()
                assert server is not None
                held.append((store.engine_id(), server.service))
                ready.set()
                await stop.wait()

    def run() -> None:
        try:
            loop.run_until_complete(main())
        except BaseException as error:
            failed.append(error)
            ready.set()
        finally:
            finish_tasks(loop)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(60) and not failed, failed
    try:
        yield held[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
        loop.close()
    assert not thread.is_alive() and not failed, f"the server did not stop cleanly: {failed}"


# a scrape of /metrics: (sample name, labels) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        return parse(response.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample of `pensieve:{name}` with `labels` (and any model name)."""
    found = [
        v
        for (n, got), v in samples.items()
        if n == f"pensieve:{name}" and dict(got, model_name="") == dict(labels, model_name="")
    ]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


async def request(client: Any, subject: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request over NATS (nats-py `client`) and its decoded answer."""
    msg = await client.request(subject, orjson.dumps(body), timeout=120)
    return dict(orjson.loads(msg.data))
