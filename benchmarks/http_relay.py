"""The HTTP ingress's own cost per streamed token, on the CPU, without a model.

Through `pensieve actor http` every streamed delta of a turn takes one more hop than over NATS:
the scheduler sends it to the HTTP ingress, which writes it to the client as a server-sent event.
At the knee of a GPU sweep the ingress relays thousands of deltas a second on one event loop, so
its cost per delta bounds the HTTP path. This measures that cost alone, in three processes over a
real nats-server:

    stepper   answers `pensieve.v1.chat` as the scheduler does: the turns in hand advance one
              token a step, each step sends one delta to every turn (`ChatDelta`), a turn's last
              step its reply (`chat_reply`, with `done`)
    ingress   the real `HttpIngressActor` (aiohttp), its CPU time counted over the load
    clients   (this process) `concurrency` streamed chat completions at a time over HTTP
              (aiohttp), each read to `[DONE]`

and prints the deltas a second through the ingress and its CPU time per delta (user + system):
with `--step-ms 0` the stepper sends as fast as it can, so the ingress is the bound.

    python -m benchmarks.http_relay --concurrency 64 --turns 512 --tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import time
from multiprocessing.synchronize import Event
from typing import Any

import orjson

HOST = "127.0.0.1"


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def stepper(url: str, tokens: int, step_ms: float, ready: Event, stop: Event) -> None:
    asyncio.run(_stepper(url, tokens, step_ms, ready, stop))


async def _stepper(url: str, tokens: int, step_ms: float, ready: Event, stop: Event) -> None:
    import nats

    from pensieve.actors.wire import subjects
    from pensieve.actors.wire.replies import ChatDelta, PromptSources, chat_reply
    from pensieve.actors.wire.request_parsing import encode_body

    client = await nats.connect(url)
    turns: list[list[Any]] = []  # [reply subject, conversation id, tokens sent]
    wake = asyncio.Event()
    number = 0

    async def take(msg: Any) -> None:
        nonlocal number
        number += 1
        turns.append([msg.reply, f"c-bench-{number:016x}", 0])
        wake.set()

    await client.subscribe(subjects.CHAT, cb=take)
    await client.flush()
    ready.set()
    while not stop.is_set():
        if not turns:
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), 0.5)
            except asyncio.TimeoutError:
                continue
        for turn in list(turns):
            reply, conv_id, sent = turn
            turn[2] = sent = sent + 1
            await client.publish(reply, encode_body(ChatDelta(" word", conv_id, sent)))
            if sent == tokens:
                body = chat_reply(
                    conv_id, 0, " word" * tokens, [7] * tokens, "length", 16, PromptSources(new=16)
                )
                await client.publish(reply, orjson.dumps({**body, "done": True}))
                turns.remove(turn)
        await asyncio.sleep(step_ms / 1000)
    await client.close()


def ingress(url: str, port: int, ready: Event, go: Event, stop: Event, out: Any) -> None:
    asyncio.run(_ingress(url, port, ready, go, stop, out))


async def _ingress(url: str, port: int, ready: Event, go: Event, stop: Event, out: Any) -> None:
    from pensieve.actors.ingress.http_actor import HttpConfig, HttpIngressActor
    from pensieve.actors.wire.bus import Bus

    bus = await Bus.connect(url)
    actor = HttpIngressActor(bus, "bench", HttpConfig(port=port, host=HOST), lambda key: None)
    await actor.start()
    ready.set()
    await asyncio.to_thread(go.wait)
    started = _cpu_s()
    await asyncio.to_thread(stop.wait)
    out.put(_cpu_s() - started)
    await actor.stop(grace_s=1.0)
    await bus.close()


async def _client(port: int, concurrency: int, turns: int) -> tuple[int, float]:
    import aiohttp

    body = orjson.dumps(
        {"model": "pensieve", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    )
    events = 0
    left = turns

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal events, left
        while left > 0:
            left -= 1
            async with session.post(f"http://{HOST}:{port}/v1/chat/completions", data=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                        events += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(one(session) for _ in range(concurrency)))
        return events, time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--turns", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128, help="deltas of each turn")
    parser.add_argument("--step-ms", type=float, default=0.0, help="time between steps")
    args = parser.parse_args(argv)

    from pensieve.ops.nats_server import EmbeddedNats, free_port

    spawn = mp.get_context("spawn")
    ready_a, ready_b, go, stop = (spawn.Event() for _ in range(4))
    out = spawn.Queue()
    port = free_port()
    with EmbeddedNats() as server:
        steps = (server.url, args.tokens, args.step_ms, ready_a, stop)
        step_process = spawn.Process(target=stepper, args=steps)
        relay = spawn.Process(target=ingress, args=(server.url, port, ready_b, go, stop, out))
        step_process.start()
        relay.start()
        try:
            for ready in (ready_a, ready_b):
                if not ready.wait(120):
                    raise RuntimeError("the stepper or the ingress did not start")
            asyncio.run(_client(port, 2, 4))  # warm-up: connections, first requests
            go.set()
            events, wall_s = asyncio.run(_client(port, args.concurrency, args.turns))
            stop.set()
            cpu_s = out.get(timeout=60)
        finally:
            stop.set()
            relay.join(30)
            step_process.join(30)
    deltas = args.turns * args.tokens
    print(
        f"| {args.concurrency} | {args.turns} x {args.tokens} | {deltas / wall_s:,.0f} "
        f"| {cpu_s / deltas * 1e6:.1f} | {cpu_s / wall_s:.2f} | {events - deltas} |"
    )
    return {"events": events, "deltas": deltas, "wall_s": wall_s, "cpu_s": cpu_s}


HEADER = (
    "| concurrency | turns x deltas | deltas/s | ingress CPU µs per delta | ingress cores busy "
    "| events beyond the deltas |\n|---|---|---|---|---|---|"
)

if __name__ == "__main__":
    print(HEADER)
    main()
