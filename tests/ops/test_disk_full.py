"""A real full disk: the store on a small tmpfs filled up by another file. A turn whose commit
finds no room is answered `internal` and leaves its conversation as before; once the space is
freed, the conversation goes on with its turns numbered as if the failed one never was. (Needs
the right to mount a tmpfs; skipped without it.)"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pensieve.actors.scheduler.chat_service import ChatService
from pensieve.ops.engine_options import EngineOptions
from pensieve.ops.factory import assemble
from pensieve.store import ConversationStore, StoreWriter
from tests.ops.test_chat_service import CHAT, turn

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path) -> Path:
    """Take every free byte of `disk` with one file; returns it."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 4096)
    return filler


def test_a_full_disk_fails_the_turn_alone_and_the_conversation_goes_on_once_freed(
    smollm2, smollm2_chat, tmp_path
) -> None:
    built = assemble(EngineOptions(model="smollm2"), smollm2, smollm2_chat)
    with (
        small_disk(tmp_path / "disk", "8m") as disk,
        ConversationStore(disk / "store", map_size=32 << 20) as store,
        StoreWriter() as writer,
    ):
        service = ChatService(built.engine, built.chat, 4096, store, writer)
        first = turn(service, message=CHAT[0]).reply
        assert first is not None
        conv_id = first["conversation_id"]
        filler = fill(disk)
        failed = turn(service, conversation_id=conv_id, message=CHAT[1])
        assert failed.refused is not None and failed.refused.code == "internal", failed.reply
        assert [r.turn for r in store.turns(conv_id)] == [0]  # as before the turn
        filler.unlink()  # room again
        again = turn(service, conversation_id=conv_id, message=CHAT[1]).reply
        assert again is not None and again["turn"] == 1
        assert [r.turn for r in store.turns(conv_id)] == [0, 1]
        assert store.turns(conv_id)[1].assistant_text == again["text"]
