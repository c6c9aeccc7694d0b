"""The load client's turns over the OpenAI API (`pensieve bench --http`), with the official
`openai` client: each turn one streamed chat completion (the first content chunk is the time to
first token) whose usage comes in a last chunk, the conversation named by the
`X-Conversation-Id` header, so the load is the same conversations as over NATS and the summary
(`ops/load.py`) reads the same.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from pensieve.actors.bus import Bus

CONVERSATION_HEADER = "X-Conversation-Id"


def api_key(tenant: Path | None) -> str:
    """The key of the tenant whose `pensieve tenant add` line is in `tenant`, else
    $OPENAI_API_KEY, else "EMPTY" (a server without accounts takes any)."""
    if tenant is None:
        return os.environ.get("OPENAI_API_KEY") or "EMPTY"
    try:
        return str(json.loads(tenant.read_text())["http"]["api_key"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{tenant} holds no HTTP API key of `pensieve tenant add` "
                         f"({error!r})") from None  # fmt: skip


def base_url(url: str) -> str:
    """The API's base URL: `url`, ending in /v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class OpenAIChatClient:
    """A `ChatClient` (ops/load.py) for the server at `base_url` (".../v1")."""

    bus: Bus | None = None  # no management probes or engine stats over HTTP

    def __init__(self, base_url: str, api_key: str, model: str | None = None) -> None:
        from openai import AsyncOpenAI  # the bench extra

        self.api = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        self.model = model

    async def close(self) -> None:
        await self.api.close()

    async def served_model(self) -> str:
        """`model`, else the first model the server lists."""
        if self.model is None:
            async for model in self.api.models.list():
                self.model = model.id
                break
        if self.model is None:
            raise OSError("the server lists no model")
        return self.model

    async def turn(
        self, body: dict[str, Any], timeout_s: float
    ) -> AsyncGenerator[dict[str, Any], None]:
        import openai

        messages = body.get("messages") or [{"role": "user", "content": body["message"]}]
        extra = {k: body[k] for k in ("conversation_id", "ignore_eos", "final") if k in body}
        try:
            raw = await self.api.chat.completions.with_raw_response.create(
                model=await self.served_model(), messages=messages,
                max_tokens=body["max_tokens"], temperature=body.get("temperature", 0.0),
                stream=True, stream_options={"include_usage": True}, extra_body=extra,
                timeout=timeout_s,
            )  # fmt: skip
            stream = raw.parse()
            if inspect.isawaitable(stream):  # openai 1.x: a coroutine
                stream = await stream
            usage = None
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content:
                        yield {"delta": choice.delta.content}
                if chunk.usage is not None:
                    usage = chunk.usage
        except openai.APIStatusError as error:
            found = error.body if isinstance(error.body, dict) else {}
            yield {"error": {"code": found.get("code") or str(error.status_code),
                             "message": found.get("message", str(error))}}  # fmt: skip
            return
        except openai.APIConnectionError as error:
            yield {"error": {"code": "unavailable", "message": str(error)}}
            return
        if usage is None:
            yield {"error": {"code": "internal", "message": "no usage in the stream"}}
            return
        details = usage.prompt_tokens_details
        sources = (details.model_extra or {}).get("sources") if details is not None else None
        if sources is None:  # another server: its cached tokens, as if from the GPU
            sources = {"gpu": (details.cached_tokens or 0) if details is not None else 0}
        cached = {k: sources.get(k, 0) for k in ("gpu", "cpu", "recomputed")}
        yield {"conversation_id": raw.headers[CONVERSATION_HEADER],
               "usage": {"prompt_tokens": usage.prompt_tokens,
                         "completion_tokens": usage.completion_tokens,
                         "cached_tokens": cached}}  # fmt: skip
