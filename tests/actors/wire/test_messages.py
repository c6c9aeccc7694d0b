"""Internal messages: each encodes with its schema version first and decodes as it was sent; a
message of another version, of none, or malformed is refused with MessageError."""

from __future__ import annotations

import msgspec
import orjson
import pytest

from pensieve.actors.wire.messages import (
    DetokenizeReply,
    DetokenizeRequest,
    MessageError,
    RecomputePlanRequest,
    RenderReply,
    RenderRequest,
    TextPiece,
    TextUpdate,
    decode,
)

PIECE = TextPiece("t", (5, 6, 7), 2, 3, 4, "ab", ("x",), False, "00-1-2-01")


def test_messages_round_trip_with_their_version_first() -> None:
    request = DetokenizeRequest((PIECE,))
    assert request.encode().startswith(b'{"v":1,')
    assert DetokenizeRequest.decode(request.encode()) == request
    reply = DetokenizeReply((TextUpdate("t", "hi", 0, 3, 4, None, None),))
    assert DetokenizeReply.decode(reply.encode()) == reply
    assert decode(RenderReply([1, 2]).encode(), RenderReply) == RenderReply([1, 2])
    plan = RecomputePlanRequest("c", None)
    assert decode(plan.encode(), RecomputePlanRequest) == plan


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"messages": []}, "schema version None"),
        ({"v": 0, "messages": []}, "schema version 0"),
        ({"v": "1", "messages": []}, "schema version '1'"),
        ({"v": 2, "messages": [], "new_field": 1}, "schema version 2"),
        ({"v": 1, "messages": [], "max_tokens": 0}, "max_tokens"),
        ({"v": 1, "messages": [], "max_tokens": True}, "max_tokens"),
        ({"v": 1, "messages": [{"role": "user", "content": "x"}], "prompt": "p"}, "prompt"),
        ([1, 2], "RenderRequest"),
    ],
)
def test_a_message_it_cannot_read_is_refused(body: object, says: str) -> None:
    with pytest.raises(MessageError, match="RenderRequest") as refused:
        decode(orjson.dumps(body), RenderRequest)
    assert says in str(refused.value)


@pytest.mark.parametrize(
    "data", [b"{", b"\xff", b'{"v": 1, "messages": [' * 3000, b"[" * 100_000 + b"]" * 100_000]
)
def test_bytes_that_are_no_message_are_refused(data: bytes) -> None:
    with pytest.raises(MessageError, match="RenderRequest"):
        decode(data, RenderRequest)


def test_a_piece_whose_offsets_do_not_fit_is_refused() -> None:
    for bad in ({"start": 4}, {"read": 9}, {"final": True}, {"stop": [""]}, {"ids": [1, "2"]}):
        body = {"v": 1, "pieces": [{**msgspec.to_builtins(PIECE), **bad}]}
        with pytest.raises(MessageError, match="DetokenizeRequest|TextPiece"):
            DetokenizeRequest.decode(orjson.dumps(body))
