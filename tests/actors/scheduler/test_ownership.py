"""Ownership over a real nats-server with JetStream and real LMDB stores, for two engines: a
conversation is held by one engine at a time, adopted (its store rebuilt from the replicated log)
once its owner's lease lapses, never written again by the old owner (fenced), scoped to its
tenant, and handed over by a release."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pensieve.actors.scheduler import ownership as ownership_module
from pensieve.actors.scheduler.ownership import Ownership, stop_task
from pensieve.actors.wire.bus import Bus
from pensieve.actors.wire.fencing import Fenced, LogUnavailable
from pensieve.actors.wire.jetstream import JetStream, Owner
from pensieve.actors.wire.schemas import ApiError
from pensieve.ops.nats_server import EmbeddedNats
from pensieve.store import ConversationStore, StoreWriter, TurnRecord, turn_log

TTL_S = 1.0
CONV = "c-aaaaaaaa-0123456789abcdef"


def record(turn: int) -> TurnRecord:
    return TurnRecord(
        turn=turn,
        user_message=f"message {turn}",
        assistant_text=f"reply {turn}",
        prompt_tokens=4,
        new_prompt_tokens=4,
        output_token_ids=(7, 8),
        finish_reason="length",
        cached_gpu=0,
        cached_cpu=0,
        cached_recomputed=0,
        started_at=1.0,
        finished_at=2.0,
    )


class Engine:
    """One engine's side: its store, writer and ownership on a bus of its own."""

    def __init__(self, engine_id: str, folder: Path, ownership: Ownership) -> None:
        self.engine_id = engine_id
        self.store = ownership.store
        self.ownership = ownership
        self.dropped: list[str] = []

    async def drop(self, conv_id: str) -> bool:
        self.dropped.append(conv_id)
        return True

    async def commit(self, conv_id: str, turn: int, tenant: str | None = None) -> None:
        """A turn as the committer writes it: the log first, then the store."""
        log = self.store.token_log(conv_id)
        entry = turn_log.committed(record(turn), len(log), [turn, turn + 1], False, False, tenant)
        await self.ownership.append(conv_id, entry)
        self.store.commit_turn(conv_id, record(turn), len(log), [turn, turn + 1], tenant=tenant)


@contextlib.asynccontextmanager
async def engine(url: str, engine_id: str, folder: Path) -> AsyncIterator[Engine]:
    bus = await Bus.connect(url)
    with ConversationStore(folder / engine_id) as store, StoreWriter() as writer:
        ownership = Ownership(JetStream(bus), engine_id, store, writer, TTL_S)
        try:
            async with ownership:
                yield Engine(engine_id, folder, ownership)
        finally:
            await bus.close()


async def lapse(one: Engine) -> None:
    """The engine stops renewing its lease (paused, cut off) until the lease is gone."""
    task = one.ownership._renewing
    assert task is not None
    await stop_task(task)
    deadline = time.monotonic() + 10 * TTL_S
    while await one.ownership.js.alive(one.engine_id):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


@pytest.fixture
def server(tmp_path: Path):
    with EmbeddedNats(jetstream_dir=tmp_path / "js") as started:
        yield started


def test_a_lapsed_owner_is_adopted_and_fenced_out(server, tmp_path: Path) -> None:
    async def go() -> None:
        async with (
            engine(server.url, "aaaaaaaa", tmp_path) as a,
            engine(server.url, "bbbbbbbb", tmp_path) as b,
        ):
            await a.commit(CONV, 0)
            await a.commit(CONV, 1)
            with pytest.raises(ApiError) as held:  # A lives: B may not take it
                await b.ownership.hold(CONV, None, b.drop)
            assert held.value.code == "unavailable"
            assert b.store.meta(CONV) is None

            await lapse(a)
            await b.ownership.hold(CONV, None, b.drop)  # adopts
            assert b.store.turns(CONV) == a.store.turns(CONV)
            assert b.store.token_log(CONV) == a.store.token_log(CONV) == [0, 1, 1, 2]
            assert b.dropped == [CONV]
            await b.commit(CONV, 2)

            # the old owner comes back: its append is refused, its store stays as it was
            with pytest.raises(Fenced):
                await a.commit(CONV, 2)
            assert a.store.meta(CONV).num_turns == 2  # type: ignore[union-attr]
            with pytest.raises(ApiError) as refused:
                await a.ownership.hold(CONV, None, a.drop)
            assert refused.value.code == "unavailable"
            entries = [turn_log.decode(d) for _, d in await b.ownership.js.read(CONV)]
            assert turn_log.num_turns(entries) == 3

    asyncio.run(go())


def test_an_adoption_cannot_slip_behind_an_append_of_the_old_owner(server, tmp_path) -> None:
    """The old owner's turn in flight when it was adopted fails, even with no turn of the new
    owner after it: the adoption's mark moved the log on."""

    async def go() -> None:
        async with (
            engine(server.url, "aaaaaaaa", tmp_path) as a,
            engine(server.url, "bbbbbbbb", tmp_path) as b,
        ):
            await a.commit(CONV, 0)
            await lapse(a)
            await b.ownership.hold(CONV, None, b.drop)
            with pytest.raises(Fenced):
                await a.commit(CONV, 1)
            await b.commit(CONV, 1)
            assert [r.turn for r in b.store.turns(CONV)] == [0, 1]

    asyncio.run(go())


def test_a_turn_in_flight_when_the_lease_lapsed_commits_unless_another_engine_took_over(
    server, tmp_path
) -> None:
    """An engine cut off long enough for its lease to lapse lets go of its conversations when
    its renewal comes back; its turn in flight then commits behind its own last entry, since no
    other engine wrote the log, and the conversation is held again. Once another engine has
    adopted it, the same commit is fenced."""

    async def renewal_finds_the_lease_gone(one: Engine) -> None:
        await lapse(one)
        ownership = one.ownership
        ownership._renewing = asyncio.get_running_loop().create_task(ownership._renew())
        deadline = time.monotonic() + 10 * TTL_S
        # let go, and a new lease taken: a put stopped before it was stored could land after
        # `lapse` saw the lease gone, and keep the engine alive past it
        while ownership.num_held or ownership._lease is None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

    async def go() -> None:
        async with (
            engine(server.url, "aaaaaaaa", tmp_path) as a,
            engine(server.url, "bbbbbbbb", tmp_path) as b,
        ):
            await a.commit(CONV, 0)
            await renewal_finds_the_lease_gone(a)
            await a.commit(CONV, 1)
            assert a.ownership.num_held == 1
            entries = [turn_log.decode(d) for _, d in await a.ownership.js.read(CONV)]
            assert turn_log.num_turns(entries) == 2

            await renewal_finds_the_lease_gone(a)
            await lapse(a)
            await b.ownership.hold(CONV, None, b.drop)  # adopts
            with pytest.raises(Fenced):
                await a.commit(CONV, 2)
            await b.commit(CONV, 2)
            assert [r.turn for r in b.store.turns(CONV)] == [0, 1, 2]

    asyncio.run(go())


def test_another_tenants_engine_never_adopts_a_conversation(server, tmp_path) -> None:
    async def go() -> None:
        async with (
            engine(server.url, "aaaaaaaa", tmp_path) as a,
            engine(server.url, "bbbbbbbb", tmp_path) as b,
        ):
            await a.commit(CONV, 0, tenant="acme")
            await lapse(a)
            for tenant in ("other", None):
                with pytest.raises(ApiError) as refused:
                    await b.ownership.hold(CONV, tenant, b.drop)
                assert refused.value.code == "not_found"
            assert b.store.meta(CONV) is None
            owner = await b.ownership.js.owner(CONV)
            assert owner is not None and owner.engine == "aaaaaaaa"  # nobody took it
            await b.ownership.hold(CONV, "acme", b.drop)
            assert b.store.meta(CONV).tenant == "acme"  # type: ignore[union-attr]

    asyncio.run(go())


def test_a_released_conversation_is_taken_at_once(server, tmp_path) -> None:
    """A drained engine lets go of its conversations: another adopts them without waiting for
    the lease to lapse."""

    async def go() -> None:
        async with engine(server.url, "bbbbbbbb", tmp_path) as b:
            async with engine(server.url, "aaaaaaaa", tmp_path) as a:
                await a.commit(CONV, 0)
                await a.ownership.release()
                assert not await b.ownership.js.alive("aaaaaaaa")
                assert await b.ownership.js.owner(CONV) is None
            await b.ownership.hold(CONV, None, b.drop)
            assert [r.turn for r in b.store.turns(CONV)] == [0]

    asyncio.run(go())


class ServerGoneBeforeClaim(JetStream):
    """The turn log of a server that goes away between a new conversation's first append and
    its claim of the owner key."""

    def __init__(self, bus: Bus, server: EmbeddedNats, conv_id: str) -> None:
        super().__init__(bus, tries=2, timeout_s=0.5)
        self.server = server
        self.conv_id = conv_id

    async def claim(self, conv_id: str, engine: str, over: Owner | None) -> int:
        if conv_id == self.conv_id:
            self.server.__exit__(None, None, None)
        return await super().claim(conv_id, engine, over)


def test_a_log_that_does_not_answer_is_unavailable(tmp_path: Path) -> None:
    """With its nats-server gone, every call on the log and the owner key tries again and then
    raises LogUnavailable, which the turn's commit answers `unavailable` (retry), where another
    failure is `internal`. A new conversation whose first append landed but whose claim was not
    answered is not held (its turn failed: nobody learns its id); a held one asked for again is
    refused `unavailable`."""

    async def go() -> None:
        started = EmbeddedNats(jetstream_dir=tmp_path / "js").__enter__()
        bus = await Bus.connect(started.url)
        new = "c-aaaaaaaa-fedcba9876543210"
        js = ServerGoneBeforeClaim(bus, started, new)
        with ConversationStore(tmp_path / "e1") as store, StoreWriter() as writer:
            ownership = Ownership(js, "e1", store, writer, TTL_S)
            await ownership.start()
            one = Engine("e1", tmp_path, ownership)
            try:
                await one.commit(CONV, 0)
                assert ownership.num_held == 1
                with pytest.raises(LogUnavailable, match="the owner of .* did not answer"):
                    await ownership.append(new, b"first")
                assert ownership.num_held == 1  # the new one is not held
                with pytest.raises(LogUnavailable, match="the log of .* did not answer"):
                    await js.append(CONV, b"second", 1, "w")
                with pytest.raises(LogUnavailable, match="did not answer"):
                    await js.read(CONV)
                with pytest.raises(LogUnavailable, match="did not answer"):
                    await js.owner(CONV)
                with pytest.raises(LogUnavailable, match="did not answer"):
                    await js.alive("e1")
                with pytest.raises(ApiError) as refused:
                    await ownership.hold(CONV, None, one.drop)
                assert refused.value.code == "unavailable"
                assert "retry" in refused.value.message
            finally:
                await ownership.release()
                await bus.close()

    asyncio.run(go())


def test_a_drain_with_its_nats_server_gone_lets_the_rest_lapse_within_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine drained after its nats-server went away (a test or benchmark stopped, its
    cluster first) tries to hand over its conversations for `RELEASE_S` at most, not for every
    call's retries over every conversation: what is not handed over lapses with the lease."""
    monkeypatch.setattr(ownership_module, "RELEASE_S", 3.0)

    async def go() -> float:
        server = EmbeddedNats(jetstream_dir=tmp_path / "js").__enter__()
        bus = await Bus.connect(server.url)
        with ConversationStore(tmp_path / "e1") as store, StoreWriter() as writer:
            ownership = Ownership(JetStream(bus), "e1", store, writer, TTL_S)
            await ownership.start()
            one = Engine("e1", tmp_path, ownership)
            try:
                for i in range(3):
                    await one.commit(f"c-aaaaaaaa-{i:016x}", 0)
                assert ownership.num_held == 3
                server.__exit__(None, None, None)
                began = time.monotonic()
                await ownership.release()
                return time.monotonic() - began
            finally:
                await bus.close()

    assert asyncio.run(go()) < 3.0 + 2.0
