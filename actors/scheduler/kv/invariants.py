"""The cache manager's invariants (`kv_manager.py`), asserted after every move by the tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pensieve.actors.scheduler.kv.kv_cache import Chunk
from pensieve.actors.wire.messages import Tier

if TYPE_CHECKING:
    from pensieve.actors.scheduler.kv.kv_manager import KVCacheManager


def check_invariants(kv: KVCacheManager) -> None:
    """The invariants of the manager's module docstring."""
    chunks = _check_users(kv)
    _check_index(kv, chunks)
    owned_gpu: dict[int, Chunk] = {}
    owned_cpu: dict[int, Chunk] = {}
    for chunk in chunks.values():
        for block, owned, where in (
            (chunk.gpu_block, owned_gpu, kv.events.gpu_where),
            (chunk.cpu_slot, owned_cpu, kv.events.cpu_where),
        ):
            if block is not None:
                assert block not in owned, f"block {block} owned twice"
                owned[block] = chunk
                assert where.get(block) is chunk, f"block {block}: wrong owner"
        if chunk.pins:
            assert chunk.tier is Tier.GPU, f"chunk {chunk.index}: pinned chunk off the GPU"
            assert not kv._reclaiming(chunk), f"chunk {chunk.index}: pinned chunk reclaimed"
    pinned = {c.conv_id for c in kv.conversations.values() if c.pinned}
    assert pinned == set(kv.users.running), "the running set is out of step"
    assert kv.users.num_pinned_chunks == sum(1 for c in chunks.values() if c.pins)
    for conv in kv.conversations.values():  # the scan hint never hides an evictable own chunk
        covered = len(conv.chunks) * kv.config.block_size
        assert conv.num_positions <= covered, f"{conv.conv_id}: positions past its chunks"
        live = any(len(c.users) == 1 and kv.live_on_gpu(c) for c in conv.chunks)
        assert conv.maybe_on_gpu or not live, f"{conv.conv_id}: live chunks hidden from scans"
        on_cpu = any(len(c.users) == 1 and c.cpu_slot is not None for c in conv.chunks)
        assert conv.maybe_on_cpu or not on_cpu, f"{conv.conv_id}: CPU chunks hidden from scans"
    pending_cpu = kv.copies.pending_slots()
    assert not pending_cpu & set(owned_cpu), "a slot being read is owned again"
    for pool, owned, pending in (
        (kv.gpu, owned_gpu, set()),
        (kv.cpu, owned_cpu, pending_cpu),
    ):
        for block in range(pool.capacity):
            held = block in owned or block in pending
            assert pool.is_free(block) != held, f"block {block}: free and owned disagree"
        assert pool.num_free + len(owned) + len(pending) == pool.capacity
    both = sum(1 for c in chunks.values() if c.gpu_block is not None and c.cpu_slot is not None)
    assert both == kv.copies.check(), "a chunk on both tiers is unaccounted for"


def _check_users(kv: KVCacheManager) -> dict[int, Chunk]:
    """Each chunk's users and pins are the conversations that list it and run; returns every
    chunk in use, by id."""
    chunks: dict[int, Chunk] = {}
    users: dict[int, set[str]] = {}
    for conv in kv.conversations.values():
        for i, chunk in enumerate(conv.chunks):
            assert chunk.index == i, f"{conv.conv_id}: chunk {i} says it is {chunk.index}"
            assert chunk.users.get(conv.conv_id) is conv, f"{conv.conv_id}: not a user of {i}"
            assert conv.conv_id not in users.get(id(chunk), set()), "listed twice"
            chunks[id(chunk)] = chunk
            users.setdefault(id(chunk), set()).add(conv.conv_id)
    for key, chunk in chunks.items():
        assert set(chunk.users) == users[key], f"chunk {chunk.index}: users out of step"
        running = sum(1 for user in chunk.users.values() if user.pinned)
        assert chunk.pins == running, f"chunk {chunk.index}: {chunk.pins} pins, {running} run"
    return chunks


def _check_index(kv: KVCacheManager, chunks: dict[int, Chunk]) -> None:
    """One sealed chunk per key, full in each user, whose keys name it; only they are shared."""
    block = kv.config.block_size
    for key, chunk in kv.index.by_key.items():
        assert chunk.key == key and id(chunk) in chunks, "a sealed chunk nobody uses"
    for chunk in chunks.values():
        if chunk.key is not None:
            assert kv.index.by_key.get(chunk.key) is chunk, "two chunks sealed under one key"
            for user in chunk.users.values():
                assert user.keys[chunk.index] == chunk.key, f"{user.conv_id}: key out of step"
                assert (chunk.index + 1) * block <= user.num_positions, "a partial chunk shared"
        else:
            assert len(chunk.users) == 1, "an unsealed chunk shared"
    shared = {key for key, chunk in chunks.items() if len(chunk.users) > 1}
    assert shared == set(kv.index.shared), "the shared set is out of step"
