"""The nouns of the two-tier conversation cache: chunks, conversations, swap orders."""

from __future__ import annotations

from dataclasses import dataclass, field

from pensieve.actors.wire.messages import Tier, tier_of


@dataclass
class Chunk:
    """KV of `block_size` consecutive positions of one conversation.

    Both ids may be set at once: a chunk swapped out to the CPU keeps its GPU block until the block
    is reused (lazy reclaim), so a conversation that returns quickly still hits the GPU.
    """

    gpu_block: int | None = None
    cpu_slot: int | None = None

    @property
    def tier(self) -> Tier:
        return tier_of(self.gpu_block, self.cpu_slot)


@dataclass
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
    # of that kind; set again whenever one is placed there
    maybe_on_gpu: bool = False
    maybe_on_cpu: bool = False
    # a turn of it waits for admission since this time: its chunks are needed within seconds,
    # so eviction takes them only after every idle conversation's
    waiting_since: float | None = None

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

    @property
    def recomputed_tokens(self) -> int:
        return sum(end - start for start, end in self.recompute_ranges)
