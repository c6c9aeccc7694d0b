"""The nouns of the two-tier conversation cache: chunks, conversations, swap orders."""

from __future__ import annotations

from dataclasses import dataclass, field

from pensieve.actors.wire.chunk_keys import ChunkKey, Namespace
from pensieve.actors.wire.messages import Tier, tier_of


@dataclass(eq=False)
class Chunk:
    """KV of positions [index * block_size, (index + 1) * block_size) of the conversations in
    `users`: one, or several whose token logs agree up to its end (then it is shared).

    Both ids may be set at once: a chunk swapped out to the CPU keeps its GPU block until the block
    is reused (lazy reclaim), so a conversation that returns quickly still hits the GPU.

    A full chunk whose KV is known is sealed under its content `key` (`chunk_keys.py`) in the
    manager's content index, where other conversations find it; only sealed chunks are shared.
    `pins` counts its users with a request running: a pinned chunk stays on the GPU.
    """

    index: int
    gpu_block: int | None = None
    cpu_slot: int | None = None
    key: ChunkKey | None = None
    users: dict[str, ConversationKV] = field(default_factory=dict, repr=False)
    pins: int = 0

    @property
    def tier(self) -> Tier:
        return tier_of(self.gpu_block, self.cpu_slot)


@dataclass(eq=False)
class ConversationKV:
    """A conversation's cached history: chunk i covers positions [i * size, (i + 1) * size).

    Positions [0, num_positions) were computed at some point; their chunk may since have moved to
    the CPU or been dropped (then its raw tokens are recomputed). A pinned conversation has a
    request running: none of its chunks may be evicted, and all of them are on the GPU.
    """

    conv_id: str
    last_active: float
    chunks: list[Chunk] = field(default_factory=list)
    num_positions: int = 0
    pinned: bool = False
    # hints that let eviction scans skip conversations: False only after a scan found no chunk
    # of its own (unshared) of that kind; set again whenever one is placed there
    maybe_on_gpu: bool = False
    maybe_on_cpu: bool = False
    # a turn of it waits for admission since this time: its chunks are needed within seconds,
    # so eviction takes them only after every idle conversation's
    waiting_since: float | None = None
    # the namespace its chunks are keyed in, and the keys of its token log's first full chunks
    # (as far as the manager was told its tokens; they may run past `num_positions`)
    namespace: Namespace = Namespace(b"")
    keys: list[ChunkKey] = field(default_factory=list, repr=False)

    def tiers(self) -> list[Tier]:
        return [chunk.tier for chunk in self.chunks]

    def block_table(self) -> list[int]:
        table = [chunk.gpu_block for chunk in self.chunks]
        if None in table:
            raise AssertionError(f"{self.conv_id}: block table asked for with chunks off the GPU")
        return table  # type: ignore[return-value]


@dataclass(frozen=True)
class Acquired:
    """Where the history of an admitted request came from, in tokens."""

    gpu_tokens: int
    cpu_tokens: int
    recompute_ranges: tuple[tuple[int, int], ...]  # position ranges to recompute, in order
    swapped_in: int = 0  # blocks copied in from the CPU tier for it
    disk_tokens: int = 0  # loaded from chunks read back from the disk tier

    @property
    def recomputed_tokens(self) -> int:
        return sum(end - start for start, end in self.recompute_ranges)


@dataclass(frozen=True)
class Found:
    """What a lookup by content attached to a conversation: its first `num_positions` positions
    are cached, `gpu_tokens` and `cpu_tokens` of them in chunks it found in the content index
    (the others it held already)."""

    num_positions: int
    gpu_tokens: int = 0
    cpu_tokens: int = 0
