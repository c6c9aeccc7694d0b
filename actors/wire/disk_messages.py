"""The executor's disk tier, asked by a scheduler in another process (sans-I/O): the messages on
`pensieve.internal.<engine>.executor.disk_*` and what a step's answer says of the tier.

    disk_read        ReadRequest(read, keys)    ->  ReadAnswer(read, found), once read
    disk_keys        (empty)                    ->  KeysPage(keys, more), ... (a streamed answer)
    disk_write_back  WriteBackRequest(...)      ->  WriteBackAnswer(held), once durable

A read's chunks stay staged in the executor until the scheduler releases the read; the release
goes on the step channel (`step_codec.release_message`), behind the plan that loads them. What
the scheduler weighs reads by (`DiskInfo`) comes with `ExecutorInfo` and every `StepResult`.
Content keys are 16 bytes (base64 in JSON).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec

from pensieve.actors.wire.messages import Message, NonNegative, decode

# a content key in JSON (24 characters of base64, quotes and a comma) and a slot or block
# number beside it; a message of them stays well within the server's payload limit
_ENTRY_BYTES = 64
_MESSAGE_SLACK = 1024  # the message's own fields and headers


class DiskInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the scheduler's books need of the executor's disk tier (`DiskReads`)."""

    num_slots: NonNegative
    read_seconds_per_chunk: float
    writable: bool

    def figures(self) -> list[float]:
        """The changing part, as a `StepResult` carries it."""
        return [self.read_seconds_per_chunk, float(self.writable)]


class ReadRequest(Message):
    """Start reading the chunks of `keys` the tier holds, for one turn (named `read`)."""

    read: str
    keys: list[bytes]

    @staticmethod
    def decode(data: bytes) -> ReadRequest:
        return decode(data, ReadRequest)


class ReadAnswer(Message):
    """The keys of read `read` staged whole and checked: a `DiskLoad` may name them."""

    read: str
    found: list[bytes]

    @staticmethod
    def decode(data: bytes) -> ReadAnswer:
        return decode(data, ReadAnswer)


class KeysPage(Message):
    """Some of the content keys on disk (and saved for it); `more`: another page follows."""

    keys: list[bytes]
    more: bool

    @staticmethod
    def decode(data: bytes) -> KeysPage:
        return decode(data, KeysPage)


class WriteBackRequest(Message):
    """Part of a clean stop's write-back (`DiskReads.write_back`): remove `drops`, then write
    the chunks of CPU slots and GPU blocks, [index, key] each, and wait until they are
    durable."""

    drops: list[bytes]
    cpu: list[tuple[NonNegative, bytes]]
    gpu: list[tuple[NonNegative, bytes]]

    @staticmethod
    def decode(data: bytes) -> WriteBackRequest:
        return decode(data, WriteBackRequest)


class WriteBackAnswer(Message):
    """How many of the request's chunks the tier holds now."""

    held: NonNegative

    @staticmethod
    def decode(data: bytes) -> WriteBackAnswer:
        return decode(data, WriteBackAnswer)


def entries_per_message(max_payload: int) -> int:
    """How many keys (with a slot or block each) one message carries within `max_payload`."""
    return max(1, (max_payload - _MESSAGE_SLACK) // _ENTRY_BYTES)


def keys_pages(keys: Sequence[bytes], max_payload: int) -> Iterator[KeysPage]:
    """`keys` in pages that fit the server's payload limit; at least one, the last not `more`."""
    size = entries_per_message(max_payload)
    for start in range(0, max(len(keys), 1), size):
        yield KeysPage(list(keys[start : start + size]), start + size < len(keys))


def write_back_requests(
    drops: Sequence[bytes],
    cpu: Sequence[tuple[int, bytes]],
    gpu: Sequence[tuple[int, bytes]],
    max_payload: int,
) -> Iterator[WriteBackRequest]:
    """One write-back as messages that fit the server's payload limit, in its order: every
    removal, then the CPU tier's chunks, then the GPU's (the most valuable first within each,
    as the books give them)."""
    size = entries_per_message(max_payload)
    drop_at = cpu_at = gpu_at = 0
    while True:
        room = size
        part_drops = list(drops[drop_at : drop_at + room])
        drop_at, room = drop_at + len(part_drops), room - len(part_drops)
        part_cpu = list(cpu[cpu_at : cpu_at + room])
        cpu_at, room = cpu_at + len(part_cpu), room - len(part_cpu)
        part_gpu = list(gpu[gpu_at : gpu_at + room])
        gpu_at += len(part_gpu)
        yield WriteBackRequest(part_drops, part_cpu, part_gpu)
        if (drop_at, cpu_at, gpu_at) == (len(drops), len(cpu), len(gpu)):
            return
