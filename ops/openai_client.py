"""The load client's turns over the OpenAI API (`pensieve bench --http`): each turn one streamed
chat completion (the first content chunk is the time to first token) whose usage comes in a
last chunk, the conversation named by the `X-Conversation-Id` header, so the load is the same
conversations as over NATS and the summary (`ops/load.py`) reads the same.

The stream is read with aiohttp and orjson, as `vllm bench serve` reads it, not with the `openai`
client: that client builds a typed object of every chunk, and at a few thousand chunks a second
one load process spends its core on them and sends its arrivals late, which would be charged to
the server. The tests talk to the server with the official client.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import orjson

from pensieve.actors.wire.bus import Bus
from pensieve.actors.wire.replies import PromptSources

CONVERSATION_HEADER = "X-Conversation-Id"


def api_key(tenant: Path | None) -> str:
    """The key of the tenant whose `pensieve tenant add` line is in `tenant`, else
    $OPENAI_API_KEY, else "EMPTY" (a server without accounts takes any)."""
    if tenant is None:
        return os.environ.get("OPENAI_API_KEY") or "EMPTY"
    try:
        return str(json.loads(tenant.read_text())["http"]["api_key"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{tenant} holds no HTTP API key of `pensieve tenant add` ({error!r})"
        ) from None


def base_url(url: str) -> str:
    """The API's base URL: `url`, ending in /v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class OpenAIChatClient:
    """A `ChatClient` (ops/load.py) for the server at `base_url` (".../v1")."""

    bus: Bus | None = None  # no management probes or engine stats over HTTP

    def __init__(self, base_url: str, api_key: str, model: str | None = None) -> None:
        self.base_url = base_url
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self.model = model
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        """One pool of connections, unbounded: the load decides how many turns run at once."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), headers=self.headers
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def served_model(self) -> str:
        """`model`, else the first model the server lists."""
        if self.model is None:
            async with self.session().get(f"{self.base_url}/models") as response:
                if response.status != 200:
                    raise OSError(
                        f"GET /models answered {response.status}: {(await response.text())[:200]}"
                    )
                listed = orjson.loads(await response.read()).get("data") or []
            if listed:
                self.model = str(listed[0]["id"])
        if self.model is None:
            raise OSError("the server lists no model")
        return self.model

    async def turn(
        self, body: dict[str, Any], timeout_s: float
    ) -> AsyncGenerator[dict[str, Any], None]:
        messages = body.get("messages") or [{"role": "user", "content": body["message"]}]
        request: dict[str, Any] = {
            "model": await self.served_model(),
            "messages": messages,
            "max_tokens": body["max_tokens"],
            "temperature": body.get("temperature", 0.0),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        request.update(
            (k, body[k])
            for k in ("conversation_id", "ignore_eos", "final", "cache_salt")
            if k in body
        )
        usage = None
        try:
            async with self.session().post(
                f"{self.base_url}/chat/completions",
                data=orjson.dumps(request),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                if response.status != 200:
                    yield {"error": _error(await response.read(), str(response.status))}
                    return
                # Pensieve's; another server names none
                conversation = response.headers.get(CONVERSATION_HEADER)
                async for line in response.content:  # server-sent events, one per line
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = orjson.loads(data)
                    if "error" in chunk:
                        yield {"error": _error(data, "internal")}
                        return
                    for choice in chunk.get("choices") or ():
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            yield {"delta": content}
                    usage = chunk.get("usage") or usage
        except (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError) as error:
            yield {"error": {"code": "unavailable", "message": repr(error)}}
            return
        if usage is None:
            yield {"error": {"code": "internal", "message": "no usage in the stream"}}
            return
        yield {"conversation_id": conversation, "usage": _client_usage(usage)}


def _client_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """The client API's `usage` of an OpenAI one: another server's cached tokens, which it does
    not place in a tier, count as found on the GPU."""
    prompt = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") or 0
    found = details.get("prompt_sources") or {"gpu": cached, "new": prompt - cached}
    sources = PromptSources.total([found])
    return {
        "prompt_tokens": prompt,
        "completion_tokens": usage["completion_tokens"],
        "cached_tokens": sources.cached,
        "prompt_sources": msgspec.structs.asdict(sources),
    }


def _error(data: bytes, status: str) -> dict[str, Any]:
    """The code and message of an OpenAI-shaped error body (the status where it has none)."""
    try:
        found = orjson.loads(data).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        found = {}
    if not isinstance(found, dict):
        found = {"message": str(found)}
    return {
        "code": found.get("code") or status,
        "message": found.get("message") or data[:200].decode(errors="replace"),
    }
