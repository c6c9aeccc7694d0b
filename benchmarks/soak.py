"""Soak: a `pensieve serve` under steady load for minutes, to see memory and the store level off.

Starts `pensieve serve --model smollm2` as a subprocess (its own nats-server port, a temporary
data dir, small KV tiers, short TTLs so expiry acts within the run) and drives a closed-loop mix
from ShareGPT: new stateful conversations of a few turns (some ending with `"final": true`) and
stateless requests (`messages`, no conversation id). Every `--interval` seconds it samples the
server process's RSS (and its nats-server's), the LMDB file's size and the pages in use, the
engine's stats and the number of conversations `conversations.list` answers. Writes
`samples.jsonl` and `summary.json` under `--out`, then prints a table and the verdict: RSS after
warm-up (first third against last third), store bytes in use and conversations stored, each as
maximum against end. Not a CI test: it runs for minutes.

    python -m benchmarks.soak [--minutes 10] [--interval 15] [--out benchmarks/results/cpu/soak/]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import orjson

from pensieve.actors.wire import subjects
from pensieve.actors.wire.bus import Bus
from pensieve.ops.load import server_stats
from pensieve.ops.sharegpt import human_turns, load_conversations

MIB = 2**20


@dataclass(frozen=True)
class SoakOptions:
    minutes: float = 10.0
    interval_s: float = 15.0
    warmup_minutes: float = 2.0  # samples before this are left out of the RSS verdict
    concurrency: int = 4
    max_turns: int = 4  # of a stateful conversation
    max_tokens: int = 16
    max_chars: int = 400  # each message cut to this, so a CPU step stays short
    stateless_share: float = 0.25  # of new conversations: one `messages` request instead
    final_share: float = 0.5  # of stateful conversations: the last turn is `"final": true`
    conversation_ttl_s: float = 60.0
    stateless_ttl_s: float = 20.0
    # small tiers, so their pages (allocated empty, touched as used) are all in RSS by the end
    # of the warm-up: what grows after it is not the KV cache filling up
    gpu_cache_tokens: int = 1024
    cpu_cache_tokens: int = 2048
    seed: int = 0


@dataclass
class LoadCounts:
    """What the clients did, in total; `latencies` since the last sample."""

    turns: int = 0
    conversations: int = 0
    stateless: int = 0
    finals: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)


# ---- the server ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(options: SoakOptions, data_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """`pensieve serve` in a process of its own, and its NATS url once it says it serves."""
    command = [
        sys.executable,
        "-m",
        "pensieve.ops.cli",
        "serve",
        "--model",
        "smollm2",
        "--data-dir",
        str(data_dir),
        "--nats-port",
        str(free_port()),
        "--gpu-cache-tokens",
        str(options.gpu_cache_tokens),
        "--cpu-cache-tokens",
        str(options.cpu_cache_tokens),
        "--conversation-ttl",
        str(options.conversation_ttl_s),
        "--stateless-ttl",
        str(options.stateless_ttl_s),
        # its own nats-server on loopback and a throwaway store: no accounts needed
        "--insecure",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as sink:
        proc = subprocess.Popen(command, stderr=sink, stdout=sink, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text().splitlines():
            if "serving on " in line:
                return proc, line.split("serving on ")[1].split()[0]
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"pensieve serve did not start:\n{log.read_text()[-4000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rss_mib(pid: int) -> float | None:
    """VmRSS of a process (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().splitlines()]
        except OSError:
            continue
    return found


def store_bytes(data_dir: Path) -> tuple[int, int | None]:
    """The size of data.mdb and the bytes in use up to its highest page, as
    `ConversationStore.used_bytes` counts them (read-only, from this process; None if the
    environment cannot be opened now)."""
    size = (data_dir / "data.mdb").stat().st_size
    try:
        env = lmdb.open(str(data_dir), readonly=True, lock=True, max_dbs=0)
    except lmdb.Error:
        return size, None
    try:
        return size, (int(env.info()["last_pgno"]) + 1) * int(env.stat()["psize"])
    finally:
        env.close()


# ---- the load -----------------------------------------------------------------------------


def prompts(options: SoakOptions, num: int = 400) -> list[list[str]]:
    """Human messages of the first `num` ShareGPT conversations, each cut to `max_chars`."""
    chosen = []
    for conv in load_conversations("sharegpt", num):
        texts = [t.text[: options.max_chars] for t in human_turns(conv) if t.text.strip()]
        if texts:
            chosen.append(texts[: options.max_turns])
    return chosen


async def turn(bus: Bus, body: dict[str, Any], counts: LoadCounts) -> str | None:
    """One non-streamed chat turn; its conversation id, or None after counting its error."""
    begin = time.perf_counter()
    try:
        async with aclosing(bus.ask(subjects.CHAT, orjson.dumps(body), 300.0)) as answer:
            reply = orjson.loads(await anext(answer))
    except Exception as error:  # a failed turn is counted, never fatal to the soak
        counts.errors[type(error).__name__] += 1
        return None
    if "error" in reply:
        counts.errors[reply["error"]["code"]] += 1
        return None
    counts.turns += 1
    counts.latencies.append(time.perf_counter() - begin)
    return str(reply["conversation_id"])


async def client(
    bus: Bus,
    texts: list[list[str]],
    options: SoakOptions,
    counts: LoadCounts,
    end: float,
    rng: random.Random,
) -> None:
    """New conversations one after another until `end`; after a failed turn it waits a second,
    so a server that is gone is not asked in a tight loop."""
    while time.monotonic() < end:
        messages = rng.choice(texts)
        base = {"max_tokens": options.max_tokens}
        counts.conversations += 1
        if rng.random() < options.stateless_share:
            counts.stateless += 1
            stateless = {**base, "messages": [{"role": "user", "content": messages[0]}]}
            if await turn(bus, stateless, counts) is None:
                await asyncio.sleep(1.0)
            continue
        final = rng.random() < options.final_share
        conversation_id = None
        for index, text in enumerate(messages):
            body: dict[str, Any] = {**base, "message": text}
            if conversation_id is not None:
                body["conversation_id"] = conversation_id
            if final and index == len(messages) - 1:
                body["final"] = True
                counts.finals += 1
            conversation_id = await turn(bus, body, counts)
            if conversation_id is None:
                await asyncio.sleep(1.0)
                break
            if time.monotonic() >= end:
                break


async def stored_conversations(bus: Bus) -> int | None:
    """How many conversations `conversations.list` answers, page by page."""
    num, cursor = 0, None
    while True:
        body = {"limit": 1000} if cursor is None else {"limit": 1000, "cursor": cursor}
        try:
            asked = bus.ask(subjects.CONVERSATIONS_LIST, orjson.dumps(body), 30.0)
            async with aclosing(asked) as answer:
                page = orjson.loads(await anext(answer))
        except Exception:
            return None
        if "error" in page:
            return None
        num += len(page["conversations"])
        cursor = page["next_cursor"]
        if cursor is None:
            return num


async def sample(
    bus: Bus, pid: int, data_dir: Path, counts: LoadCounts, begin: float
) -> dict[str, Any]:
    stats = await server_stats(bus) or {}
    data_mdb, used = await asyncio.to_thread(store_bytes, data_dir)
    latencies, counts.latencies = counts.latencies, []
    nats = [rss_mib(child) for child in children(pid)]
    return {
        "t_s": round(time.monotonic() - begin, 1),
        "rss_mib": rss_mib(pid),
        "nats_rss_mib": sum(r for r in nats if r is not None),
        "data_mdb_bytes": data_mdb,
        "used_bytes": used,
        "stored_conversations": await stored_conversations(bus),
        "cached_conversations": stats.get("cache", {}).get("conversations"),
        "turns_finished": stats.get("requests", {}).get("finished"),
        "turns_in_flight": stats.get("turns_in_flight"),
        "client_turns": counts.turns,
        "client_errors": sum(counts.errors.values()),
        "latency_p50_s": statistics.median(latencies) if latencies else None,
    }


async def soak(
    options: SoakOptions, url: str, server: subprocess.Popen, data_dir: Path, out: Path
) -> LoadCounts:
    """Drive the load for `options.minutes`, sampling every `options.interval_s` into
    `out/samples.jsonl` (and stdout) as it goes; stops early if the server exits."""
    # Bus.connect retries until the server lets it in: a refusal would hang the soak
    bus = await asyncio.wait_for(Bus.connect(url, name="pensieve-soak"), 60.0)
    counts, texts = LoadCounts(), prompts(options)
    begin = time.monotonic()
    end = begin + options.minutes * 60
    rng = random.Random(options.seed)
    clients = [
        asyncio.create_task(client(bus, texts, options, counts, end, random.Random(rng.random())))
        for _ in range(options.concurrency)
    ]
    try:
        with (out / "samples.jsonl").open("w") as sink:
            while True:
                row = await sample(bus, server.pid, data_dir, counts, begin)
                sink.write(orjson.dumps(row).decode() + "\n")
                sink.flush()
                print(orjson.dumps(row).decode(), flush=True)
                if time.monotonic() >= end or server.poll() is not None:
                    break
                await asyncio.sleep(min(options.interval_s, max(end - time.monotonic(), 0)))
        if server.poll() is None:
            await asyncio.gather(*clients)
    finally:
        for task in clients:
            task.cancel()
        await bus.close()
    return counts


# ---- the verdict --------------------------------------------------------------------------


def verdict(samples: list[dict[str, Any]], options: SoakOptions) -> dict[str, Any]:
    """RSS growth after warm-up (mean of the last third against the first third), and the
    store's bytes in use and conversations stored, maximum against end."""
    after = [s for s in samples if s["t_s"] >= options.warmup_minutes * 60 and s["rss_mib"]]
    third = max(len(after) // 3, 1)
    first = statistics.mean(s["rss_mib"] for s in after[:third]) if after else float("nan")
    last = statistics.mean(s["rss_mib"] for s in after[-third:]) if after else float("nan")
    used = [s["used_bytes"] for s in samples if s["used_bytes"] is not None]
    stored = [s["stored_conversations"] for s in samples if s["stored_conversations"] is not None]
    return {
        "rss_first_third_mib": round(first, 1),
        "rss_last_third_mib": round(last, 1),
        "rss_growth_mib": round(last - first, 1),
        "rss_growth_pct": round(100 * (last - first) / first, 1) if first else None,
        "used_bytes_max": max(used, default=None),
        "used_bytes_end": used[-1] if used else None,
        "data_mdb_bytes_end": samples[-1]["data_mdb_bytes"] if samples else None,
        "stored_conversations_max": max(stored, default=None),
        "stored_conversations_end": stored[-1] if stored else None,
    }


def table(samples: list[dict[str, Any]], options: SoakOptions) -> str:
    """About one row a minute, and the last sample."""
    every = max(round(60 / options.interval_s), 1)
    rows = [s for i, s in enumerate(samples) if i % every == 0 or i == len(samples) - 1]
    lines = [
        "| min | RSS MiB | nats MiB | data.mdb MiB | used MiB | stored | cached | turns |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def mib(value: int | None) -> str:
        return "-" if value is None else f"{value / MIB:.2f}"

    for s in rows:
        lines.append(
            f"| {s['t_s'] / 60:.1f} | {s['rss_mib'] or 0:.0f} | {s['nats_rss_mib']:.0f} "
            f"| {mib(s['data_mdb_bytes'])} | {mib(s['used_bytes'])} "
            f"| {s['stored_conversations']} | {s['cached_conversations']} "
            f"| {s['turns_finished']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=SoakOptions.minutes)
    p.add_argument("--interval", type=float, default=SoakOptions.interval_s, metavar="S")
    p.add_argument("--warmup", type=float, default=SoakOptions.warmup_minutes, metavar="MIN")
    p.add_argument("--concurrency", type=int, default=SoakOptions.concurrency)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/soak"))
    args = p.parse_args(argv)
    options = SoakOptions(
        minutes=args.minutes,
        interval_s=args.interval,
        warmup_minutes=args.warmup,
        concurrency=args.concurrency,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pensieve-soak-") as tmp:
        data_dir = Path(tmp) / "data"
        proc, url = start_server(options, data_dir, Path(tmp) / "serve.log")
        try:
            counts = asyncio.run(soak(options, url, proc, data_dir, args.out))
        finally:
            exited = proc.poll()
            stop_server(proc)
        if exited is not None:
            print(f"pensieve serve exited ({exited}) during the soak:", file=sys.stderr)
            print((Path(tmp) / "serve.log").read_text()[-4000:], file=sys.stderr)
    samples = [orjson.loads(line) for line in (args.out / "samples.jsonl").read_text().splitlines()]
    result = {
        "options": asdict(options),
        "verdict": verdict(samples, options),
        "load": {
            "turns": counts.turns,
            "conversations": counts.conversations,
            "stateless": counts.stateless,
            "finals": counts.finals,
            "errors": dict(counts.errors),
        },
    }
    (args.out / "summary.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(table(samples, options))
    print(
        orjson.dumps(
            {"load": result["load"], "verdict": result["verdict"]}, option=orjson.OPT_INDENT_2
        ).decode()
    )
    return 0 if counts.turns else 1


if __name__ == "__main__":
    sys.exit(main())
