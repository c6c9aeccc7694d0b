"""Which engine holds which prompt prefix, rebuilt from the KV event plane of many engines (pure).

A router subscribes to `pensieve.v1.engine.*.kv` and applies every batch here; for a prompt's
chunk keys (`chunk_keys.keys_of(seed, prompt ids, block_size)`, the seed naming the model, the
tenant and the cache salt) `match` tells, per engine, how many of its leading chunks that engine
holds and on which tier. A chunk key names the whole prefix up to the end of its chunk, so a
prompt's leading run of held keys is the prefix an engine would reuse for it.

Per engine it keeps, as a tier map does, each conversation's chunks as the events name them
(key and tier), and for each key the chunks named by it. Every user of a shared chunk is told of
each of its moves, so the latest event naming a key gives the key's tier. A key counts while its
chunk is on the GPU or the CPU tier; it leaves when its chunk is dropped, unsealed or freed.

Batches of an engine must come in `seq` order. After a gap (a batch lost: NATS delivers at most
once) the engine's entries may lie, so they are emptied and the engine is marked `stale`; the
index goes on applying its batches, so what it knows of that engine from then on is true but
partial (a chunk that has not moved since the gap is missing), until the engine's next batch 1 (a
restarted engine, whose tiers start empty) makes it exact again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pensieve.actors.wire.messages import KvEvent, KvEventBatch, KvEventKind, Tier, tier_of

ChunkKey = bytes


@dataclass(frozen=True)
class PrefixMatch:
    """The leading chunks of a prompt that one engine holds: `tiers[i]` is where chunk i is
    (GPU or CPU). `stale`: the engine's entries were emptied after a missed batch."""

    engine_id: str
    tiers: tuple[Tier, ...]
    stale: bool = False

    @property
    def num_chunks(self) -> int:
        return len(self.tiers)

    @property
    def num_gpu_chunks(self) -> int:
        return sum(tier is Tier.GPU for tier in self.tiers)


@dataclass
class _Held:
    chunks: set[tuple[str, int]] = field(default_factory=set)  # (conversation, index)
    tier: Tier = Tier.DROPPED


@dataclass
class _Engine:
    last_seq: int = 0
    stale: bool = False
    convs: dict[str, list[ChunkKey | None]] = field(default_factory=dict)
    keys: dict[ChunkKey, _Held] = field(default_factory=dict)

    def apply(self, event: KvEvent) -> None:
        conv_id = event.conversation_id
        chunks = self.convs.setdefault(conv_id, [])
        if event.kind is KvEventKind.REMOVED:
            for index in range(event.index, len(chunks)):
                self._unname(conv_id, index, chunks[index])
            del chunks[event.index :]
        else:
            chunks.extend([None] * (event.index + 1 - len(chunks)))
            if chunks[event.index] != event.key:
                self._unname(conv_id, event.index, chunks[event.index])
                chunks[event.index] = event.key
            if event.key is not None:
                held = self.keys.setdefault(event.key, _Held())
                held.chunks.add((conv_id, event.index))
                held.tier = tier_of(event.gpu_block, event.cpu_slot)
        if not chunks:
            del self.convs[conv_id]

    def _unname(self, conv_id: str, index: int, key: ChunkKey | None) -> None:
        """The chunk (conversation, index) is named `key` no more."""
        if key is not None:
            held = self.keys[key]
            held.chunks.discard((conv_id, index))
            if not held.chunks:
                del self.keys[key]

    def tier(self, key: ChunkKey) -> Tier:
        held = self.keys.get(key)
        return Tier.DROPPED if held is None else held.tier


class PrefixIndex:
    """The chunk keys each engine holds, from the KV event batches of all of them."""

    def __init__(self) -> None:
        self._engines: dict[str, _Engine] = {}

    def apply(self, batch: KvEventBatch) -> None:
        """The next batch of `batch.engine_id` (see the module docstring for gaps)."""
        engine = self._engines.setdefault(batch.engine_id, _Engine())
        if batch.seq == 1 or batch.seq != engine.last_seq + 1:
            engine = self._engines[batch.engine_id] = _Engine(stale=batch.seq != 1)
        engine.last_seq = batch.seq
        for event in batch.events:
            engine.apply(event)

    def forget(self, engine_id: str) -> None:
        """The engine is gone (stopped, or left the pool)."""
        self._engines.pop(engine_id, None)

    @property
    def engine_ids(self) -> list[str]:
        return list(self._engines)

    def stale(self) -> set[str]:
        """Engines whose entries were emptied after a missed batch, until their next batch 1."""
        return {engine_id for engine_id, engine in self._engines.items() if engine.stale}

    def held(self, engine_id: str) -> dict[ChunkKey, Tier]:
        """Every key the engine holds on a tier, and where."""
        engine = self._engines.get(engine_id)
        keys = engine.keys if engine is not None else {}
        return {key: held.tier for key, held in keys.items() if held.tier is not Tier.DROPPED}

    def snapshot(self, engine_id: str) -> dict[str, tuple[ChunkKey | None, ...]]:
        """Each of the engine's conversations: its chunks' keys, in order (None: unsealed)."""
        engine = self._engines.get(engine_id)
        convs = engine.convs if engine is not None else {}
        return {conv_id: tuple(keys) for conv_id, keys in convs.items()}

    def match(self, keys: Sequence[ChunkKey]) -> dict[str, PrefixMatch]:
        """For each engine, the longest run of `keys`' leading chunks it holds on a tier."""
        return {engine_id: self._match(engine_id, keys) for engine_id in self._engines}

    def best(self, keys: Sequence[ChunkKey], among: Iterable[str] | None = None) -> PrefixMatch:
        """The engine (of `among`, default all) that holds the longest prefix of `keys`, with
        more of it on the GPU on a tie, a stale one last; an empty match if none is known."""
        engine_ids = list(self._engines if among is None else among)
        matches = [self._match(engine_id, keys) for engine_id in engine_ids]
        if not matches:
            return PrefixMatch("", ())
        return max(matches, key=lambda m: (m.num_chunks, m.num_gpu_chunks, not m.stale))

    def _match(self, engine_id: str, keys: Sequence[ChunkKey]) -> PrefixMatch:
        engine = self._engines.get(engine_id)
        if engine is None:
            return PrefixMatch(engine_id, ())
        tiers: list[Tier] = []
        for key in keys:
            tier = engine.tier(key)
            if tier is Tier.DROPPED:
                break
            tiers.append(tier)
        return PrefixMatch(engine_id, tuple(tiers), engine.stale)
