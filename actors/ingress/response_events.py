"""A streamed response's server-sent events, as OpenAI's Responses API sends them (no I/O).

    response.created, response.in_progress          the response, in progress
    response.output_item.added                      the assistant's message, empty (once the
    response.content_part.added                     reply has text; its text part, empty)
    response.output_text.delta ...                  the text as the engine finds it
    response.output_text.done, content_part.done,   the whole text, part and message
    response.output_item.done
    for each function call the reply makes:
      response.output_item.added                    the call, its arguments empty
      response.function_call_arguments.delta        its arguments
      response.function_call_arguments.done
      response.output_item.done                     the call
    response.completed (or .incomplete)             the response with its usage

Each event is `event: <type>` and `data: <json>` with `type` and a `sequence_number` counting
from 0; an error after the stream began is one `error` event, and the stream ends. A reply's
calls are read from its whole text, so they come out together once it has ended.
"""

from __future__ import annotations

from typing import Any

import orjson

from pensieve.actors.ingress.openai_errors import OpenAIError
from pensieve.actors.ingress.responses import ResponseRef, message_item, output_text


class ResponseEvents:
    """The events of one streamed response, numbered in the order they are made."""

    def __init__(self, ref: ResponseRef, opened: dict[str, Any]) -> None:
        """`opened`: the response object in progress (`responses.response`)."""
        self.ref = ref
        self.opened = opened
        self.text = ""
        self._sequence = 0
        self._message_open = False
        self._at = {"item_id": message_item(ref, "", "in_progress")["id"], "output_index": 0}

    def opening(self) -> list[bytes]:
        return [
            self._event("response.created", {"response": self.opened}),
            self._event("response.in_progress", {"response": self.opened}),
        ]

    def delta(self, text: str) -> list[bytes]:
        """More of the reply's text (the message opened before its first)."""
        self.text += text
        delta = {**self._at, "content_index": 0, "delta": text, "logprobs": []}
        return [*self._open_message(), self._event("response.output_text.delta", delta)]

    def closing(self, finished: dict[str, Any]) -> list[bytes]:
        """`finished`: the response object of the whole reply."""
        events: list[bytes] = []
        if self._message_open and finished["output"][0]["type"] != "message":  # no text after all
            events += self._close_message(message_item(self.ref, "", "completed"))
        for index, item in enumerate(finished["output"]):
            if item["type"] == "message":
                events += self._open_message() + self._close_message(item)
            else:
                events += self._call(index, item)
        kind = "completed" if finished["status"] == "completed" else "incomplete"
        return [*events, self._event(f"response.{kind}", {"response": finished})]

    def error(self, error: OpenAIError) -> bytes:
        body = {"code": error.code, "message": error.message, "param": error.param}
        return self._event("error", body)

    def _open_message(self) -> list[bytes]:
        if self._message_open:
            return []
        self._message_open = True
        item = message_item(self.ref, "", "in_progress")
        part = {**self._at, "content_index": 0, "part": output_text("")}
        return [
            self._event("response.output_item.added", {"output_index": 0, "item": item}),
            self._event("response.content_part.added", part),
        ]

    def _close_message(self, item: dict[str, Any]) -> list[bytes]:
        text = item["content"][0]["text"] if item["content"] else ""
        at = {**self._at, "content_index": 0}
        return [
            self._event("response.output_text.done", {**at, "text": text, "logprobs": []}),
            self._event("response.content_part.done", {**at, "part": output_text(text)}),
            self._event("response.output_item.done", {"output_index": 0, "item": item}),
        ]

    def _call(self, index: int, item: dict[str, Any]) -> list[bytes]:
        """The events of a function call, output item `index`."""
        at = {"item_id": item["id"], "output_index": index}
        opened = {**item, "arguments": "", "status": "in_progress"}
        arguments = item["arguments"]
        return [
            self._event("response.output_item.added", {"output_index": index, "item": opened}),
            self._event("response.function_call_arguments.delta", {**at, "delta": arguments}),
            self._event(
                "response.function_call_arguments.done",
                {**at, "name": item["name"], "arguments": arguments},
            ),
            self._event("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def _event(self, kind: str, body: dict[str, Any]) -> bytes:
        data = orjson.dumps({"type": kind, "sequence_number": self._sequence, **body})
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"
