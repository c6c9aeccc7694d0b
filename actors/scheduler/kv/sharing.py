"""Chunks shared by content: who uses each chunk, and sealing and finding chunks by their keys
(pure: no tensors, no I/O).

A chunk's users are the conversations that list it, its pins those of them that run
(`ChunkUsers`); a chunk nobody uses is freed. A full chunk whose KV is known is sealed under its
content key (`chunk_keys.py`) in the manager's content index when its turn ends; a conversation
whose token log has the same prefix then uses that chunk instead of one of its own
(`ContentSharing.lookup`), and a chunk computed twice merges with the sealed one (`seal`). Both
are parts of the cache manager's books (`kv_manager.py`), whose invariants they keep.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from pensieve.actors.scheduler.kv.content_index import ContentIndex
from pensieve.actors.scheduler.kv.kv_cache import Chunk, ConversationKV, Found
from pensieve.actors.wire.chunk_keys import Namespace
from pensieve.actors.wire.messages import KvEventKind

if TYPE_CHECKING:
    from pensieve.actors.scheduler.kv.kv_manager import KVCacheManager


class ChunkUsers:
    """Which conversations use each chunk (`Chunk.users`, kept by the content index) and which
    of them run (`Chunk.pins`); a chunk that none uses any more is handed to `free`."""

    def __init__(self, index: ContentIndex, free: Callable[[Chunk], None]) -> None:
        self.index = index
        self.free = free
        self.running: dict[str, ConversationKV] = {}  # the pinned conversations
        self.num_pinned_chunks = 0  # distinct chunks with a running user

    def new_chunk(self, conv: ConversationKV) -> Chunk:
        """A chunk of the conversation's own, appended to it (on no tier yet)."""
        chunk = Chunk(len(conv.chunks))
        conv.chunks.append(chunk)
        self.join(conv, chunk)
        return chunk

    def join(self, conv: ConversationKV, chunk: Chunk) -> None:
        self.index.add_user(chunk, conv)
        if conv.pinned:
            chunk.pins += 1
            self.num_pinned_chunks += chunk.pins == 1

    def leave(self, conv: ConversationKV, chunk: Chunk) -> None:
        """The conversation uses the chunk no more; freed if nobody does."""
        if conv.pinned:
            chunk.pins -= 1
            self.num_pinned_chunks -= chunk.pins == 0
        if self.index.remove_user(chunk, conv):
            self.free(chunk)

    def replace(self, conv: ConversationKV, old: Chunk, new: Chunk) -> None:
        """The conversation uses `new` in the place of `old`."""
        conv.chunks[old.index] = new
        self.leave(conv, old)
        self.join(conv, new)

    def pin(self, conv: ConversationKV) -> None:
        if conv.pinned:
            return
        conv.pinned = True
        self.running[conv.conv_id] = conv
        for chunk in conv.chunks:
            chunk.pins += 1
            self.num_pinned_chunks += chunk.pins == 1

    def unpin(self, conv: ConversationKV) -> None:
        if not conv.pinned:
            return
        conv.pinned = False
        del self.running[conv.conv_id]
        for chunk in conv.chunks:
            chunk.pins -= 1
            self.num_pinned_chunks -= chunk.pins == 0


class ContentSharing:
    """The cache manager's sealing and lookup by content (its `seal`, `rekey` and `lookup`)."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv

    def seal(self, conv: ConversationKV, tokens: Sequence[int]) -> None:
        """`tokens` begin with the idle conversation's token log: key its full computed chunks
        and seal them in the content index. A chunk whose content is sealed already (computed
        twice) merges with that one: the better placed of the two serves all their users."""
        assert not conv.pinned
        kv, users = self.kv, self.kv.users
        block = kv.config.block_size
        full = min(conv.num_positions, len(tokens)) // block
        conv.namespace.extend(conv.keys, tokens[: full * block], block)
        for i in range(min(full, len(conv.keys), len(conv.chunks))):
            chunk, key = conv.chunks[i], conv.keys[i]
            if chunk.key == key:
                continue
            assert chunk.key is None and len(chunk.users) == 1, f"{conv.conv_id}: chunk {i} keyed"
            sealed = kv.index.get(key)
            if sealed is None:
                if chunk.gpu_block is not None or chunk.cpu_slot is not None:
                    kv.index.seal(chunk, key)
                    kv.events.emit(KvEventKind.SEALED, chunk)
            elif kv.place(chunk) <= kv.place(sealed):
                users.replace(conv, chunk, sealed)
                kv.events.emit_for(KvEventKind.STORED, conv.conv_id, sealed)
            else:  # the sealed copy is off the GPU (or dropped): this one serves its users
                others = list(sealed.users.values())
                for user in others:
                    users.leave(user, sealed)  # the last one frees it and takes it off the index
                kv.index.seal(chunk, key)
                kv.events.emit(KvEventKind.SEALED, chunk)
                for user in others:
                    user.chunks[i] = chunk
                    users.join(user, chunk)
                    kv.events.emit_for(KvEventKind.STORED, user.conv_id, chunk)

    def rekey(self, conv: ConversationKV, namespace: Namespace) -> None:
        """Key the idle conversation's chunks in `namespace` from now on (a turn of it came with
        another cache salt, or it was restored without one). Whatever it has cached was keyed in
        the old namespace, so it is forgotten; a conversation restored from its token log (all
        dropped) keeps that log to recompute."""
        kv = self.kv
        if conv.namespace == namespace:
            return
        if any(kv.place(chunk) for chunk in conv.chunks):
            kv.truncate(conv, 0)
        for chunk in conv.chunks:
            if chunk.key is not None:  # dropped, sealed: recomputed as a chunk of its own
                kv.users.replace(conv, chunk, Chunk(chunk.index))
                kv.events.emit_for(KvEventKind.DROPPED, conv.conv_id, conv.chunks[chunk.index])
        conv.keys.clear()
        conv.namespace = namespace

    def lookup(
        self, conv: ConversationKV, tokens: Sequence[int], on_disk: Collection[bytes] = ()
    ) -> Found:
        """Attach to the idle conversation the longest run of leading full chunks of `tokens`
        that are cached (on the GPU or the CPU tier), its own or found by content, or read from
        the disk tier for this turn (keys in `on_disk`: attached dropped, `acquire` loads them);
        returns how many positions that run covers, and how many of them it found by content
        where.

        `tokens` begin with the conversation's token log (cut first, with `truncate`, where they
        differ from it) and end before the positions the caller computes anyway (at least the
        last token of a prompt, whose logits are wanted)."""
        assert not conv.pinned
        kv = self.kv
        block = kv.config.block_size
        conv.namespace.extend(conv.keys, tokens, block)
        gpu = cpu = found = 0
        for i in range(len(tokens) // block):
            own = conv.chunks[i] if i < len(conv.chunks) else None
            sealed = kv.index.get(conv.keys[i])
            mine = own is not None and (own is sealed or own.key is None) and kv.place(own)
            if mine and (i + 1) * block <= conv.num_positions:  # full, and its own
                found = i + 1
                continue
            uncached = sealed is None or not kv.place(sealed)
            if uncached and conv.keys[i] in on_disk and (own is None or not kv.place(own)):
                if own is None:  # dropped, as a conversation restored from its token log
                    kv.events.emit(KvEventKind.DROPPED, kv.users.new_chunk(conv))
                found = i + 1
                continue
            if sealed is None or not kv.place(sealed):
                break
            if own is None:
                kv.index.add_user(sealed, conv)
                conv.chunks.append(sealed)
            else:
                kv.users.replace(conv, own, sealed)
            kv.events.emit_for(KvEventKind.STORED, conv.conv_id, sealed)
            if kv.live_on_gpu(sealed):
                gpu += block
            else:
                cpu += block
            found = i + 1
        conv.num_positions = max(conv.num_positions, found * block)
        conv.maybe_on_gpu = conv.maybe_on_cpu = True
        return Found(found * block, gpu, cpu)
