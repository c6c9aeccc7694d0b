"""Agentic sessions: the workload of `pensieve bench agentic`, generated under a seed.

A session is a coding agent at work. Every session starts from one system prompt, shared by all,
that defines the agent's tools and is `system_tokens` long. Its first turn is a user's request (a
human message from ShareGPT); each later turn is the result of a tool call, sent as a user
message framed as tool output (`<tool_result name="read_file">...</tool_result>`: the client API
takes the roles system, user and assistant only). Each turn asks for a short reply of a drawn
length, and a drawn tool time passes between a reply and the next turn.

    turns per session   log-normal, mean `turns_mean` (sigma 0.5), at least 1; a session ends
                        before a turn that would take its context past `max_context`
    tokens a turn adds  uniform in `added_tokens` (the request: a whole human message, cut there)
    reply tokens        uniform in `output_tokens`
    tool time           exponential, mean `tool_time_s`

Each turn also carries a recorded reply: ShareGPT reply text about as many tokens long as the
reply asked for, which a client that resends its history may send in place of what the server
generated (as harnesses that replay recorded transcripts do). A run may add one long prompt
(`LongPrompt`): a single-turn request of ShareGPT text beside the sessions.

Tool output is real text: source files of pure-Python packages this one depends on (read in
sorted order) for the code tools, ShareGPT replies for the documentation tools, each a window of
whole lines. Every count a session reports is measured with the model's tokenizer on the text it
sends, so the server's chat template and tokenizer do real work on real lengths.
"""

from __future__ import annotations

import bisect
import dataclasses
import importlib.util
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.ops.sharegpt import SHAREGPT, Role, load_conversations

CODE_PACKAGES = ("nats", "aiohttp")  # pure-Python sources, installed with pensieve
CORPUS_CHARS = 1 << 20  # of each kind of text; windows are drawn from anywhere in it
MIN_CORPUS_CHARS = 1 << 17
TURNS_SIGMA = 0.5
LONG_PROMPT_AT_S = 2.0  # into the run: the sessions are past their first turns


@dataclass(frozen=True)
class Span:
    """Integers drawn uniformly from `low` to `high`, both included."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"a range must be 1 <= LOW <= HIGH, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, text: str) -> Span:
        """`LOW:HIGH`, or `N` for N alone."""
        low, _, high = text.partition(":")
        try:
            return cls(int(low), int(high or low))
        except ValueError as error:
            raise ValueError(f"expected LOW:HIGH or N, got {text!r} ({error})") from None

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True)
class LongPrompt:
    """One stateless single-turn request of `num_tokens` prompt tokens, sent `at_s` seconds
    into a run."""

    num_tokens: int
    at_s: float = LONG_PROMPT_AT_S

    def __post_init__(self) -> None:
        if self.num_tokens < 1 or not 0 <= self.at_s < math.inf:
            raise ValueError(f"--long-prompt needs N >= 1 and T >= 0, got {self}")

    @classmethod
    def parse(cls, text: str) -> LongPrompt:
        """`N`, or `N@T` (seconds)."""
        tokens, at_sign, at = text.partition("@")
        try:
            return cls(int(tokens), float(at) if at_sign else LONG_PROMPT_AT_S)
        except ValueError as error:
            raise ValueError(f"--long-prompt: expected N or N@T, got {text!r} ({error})") from None


@dataclass(frozen=True)
class AgenticConfig:
    num_sessions: int = 32
    system_tokens: int = 6000
    turns_mean: float = 20.0
    added_tokens: Span = Span(1000, 4000)
    output_tokens: Span = Span(100, 500)
    max_context: int = 65536
    tool_time_s: float = 1.0
    seed: int = 0
    long_prompt: LongPrompt | None = None

    def __post_init__(self) -> None:
        if self.num_sessions < 1:
            raise ValueError(f"--sessions must be >= 1, got {self.num_sessions}")
        if self.turns_mean < 1:
            raise ValueError(f"--turns-mean must be >= 1, got {self.turns_mean:g}")
        if self.tool_time_s < 0 or not math.isfinite(self.tool_time_s):
            raise ValueError(f"--tool-time-s must be >= 0, got {self.tool_time_s:g}")


@dataclass(frozen=True)
class Tool:
    name: str
    source: str  # "code" or "text": the corpus its output is read from
    description: str
    parameters: tuple[str, ...]


TOOLS = (
    Tool("read_file", "code", "Read lines of a file of the repository.", ("path", "start", "end")),
    Tool("grep", "code", "Search the repository for a regular expression.", ("pattern", "path")),
    Tool("run_tests", "code", "Run the tests and show the failing code.", ("selector",)),
    Tool("web_fetch", "text", "Fetch a web page as text.", ("url",)),
    Tool("search_docs", "text", "Search the project's documentation.", ("query",)),
)
TOOL_WEIGHTS = (4, 2, 1, 1, 2)


@dataclass(frozen=True)
class Turn:
    text: str  # the user message's content
    num_tokens: int  # of `text`, without the chat template's own tokens
    max_tokens: int  # the reply asked for
    tool: str | None  # the tool whose output `text` is (None: the user's request)
    tool_time_s: float  # from the reply to the next turn (0 after the last)
    reply: str  # the recorded reply: ShareGPT text of about `max_tokens` tokens


@dataclass(frozen=True)
class Session:
    id: str
    turns: tuple[Turn, ...]
    context_tokens: int  # the chat template's tokens of the whole session, replies included

    def messages(self, system: str, replies: list[str]) -> list[dict[str, str]]:
        """The chat of turn `len(replies)`: the system prompt, each turn and its reply, then
        the turn's own message."""
        chat = [{"role": "system", "content": system}]
        for turn, reply in zip(self.turns, replies, strict=False):
            chat += [
                {"role": "user", "content": turn.text},
                {"role": "assistant", "content": reply},
            ]
        return [*chat, {"role": "user", "content": self.turns[len(replies)].text}]

    def recorded(self, index: int) -> list[str]:
        """The recorded replies of the turns before turn `index`."""
        return [turn.reply for turn in self.turns[:index]]


@dataclass(frozen=True)
class Workload:
    config: AgenticConfig
    system: str  # the prompt every session starts from
    system_tokens: int
    sessions: tuple[Session, ...]
    long_prompt: str | None = None  # the text of `config.long_prompt`

    def summary(self) -> dict[str, Any]:
        """What was generated, in tokens of the model's tokenizer."""
        turns = [t for s in self.sessions for t in s.turns]
        contexts = [s.context_tokens for s in self.sessions]
        found: dict[str, Any] = {
            "seed": self.config.seed,
            "sessions": len(self.sessions),
            "turns": len(turns),
            "turns_per_session": len(turns) / len(self.sessions),
            "system_tokens": self.system_tokens,
            "added_tokens": sum(t.num_tokens for t in turns),
            "added_tokens_mean": sum(t.num_tokens for t in turns) / len(turns),
            "output_tokens": sum(t.max_tokens for t in turns),
            "output_tokens_mean": sum(t.max_tokens for t in turns) / len(turns),
            "tool_time_s_mean": sum(t.tool_time_s for t in turns) / len(turns),
            "context_tokens_mean": sum(contexts) / len(contexts),
            "context_tokens_max": max(contexts),
            "max_context": self.config.max_context,
        }
        if self.config.long_prompt is not None:
            found["long_prompt"] = dataclasses.asdict(self.config.long_prompt)
        return found


class Source:
    """A long text, tokenized once: windows of it a given number of tokens long, each starting
    at a line."""

    def __init__(self, chat: ChatTokenizer, text: str) -> None:
        encoded = chat.tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        self.text = text
        self.spans: list[tuple[int, int]] = [tuple(s) for s in encoded["offset_mapping"]]
        # tokens that begin a line: where a window may start
        self.line_starts = [
            i for i, (start, _) in enumerate(self.spans) if start == 0 or text[start - 1] == "\n"
        ]

    def window(self, rng: random.Random, num_tokens: int) -> str:
        last = bisect.bisect_right(self.line_starts, len(self.spans) - num_tokens)
        if last == 0:
            raise ValueError(
                f"{num_tokens} tokens of tool output: more than the corpus holds "
                f"({len(self.spans)} tokens)"
            )
        first = self.line_starts[rng.randrange(last)]
        return self.text[self.spans[first][0] : self.spans[first + num_tokens - 1][1]]


@dataclass(frozen=True)
class Corpus:
    """The real text sessions are made of, and the tokenizer that measures it."""

    chat: ChatTokenizer
    code: Source
    text: Source
    requests: tuple[str, ...]  # ShareGPT human messages

    @classmethod
    def load(
        cls, chat: ChatTokenizer, chars: int = CORPUS_CHARS, sharegpt: str | Path = SHAREGPT
    ) -> Corpus:
        """`chars` characters of each kind of text (see `corpus_chars`); the requests and the
        documentation from the ShareGPT conversations of `sharegpt` (`ops/sharegpt.py`)."""
        requests, replies, size = [], [], 0
        for conv in load_conversations(sharegpt, 2000):
            for message in conv.turns:
                if message.role is Role.HUMAN and message.text.strip():
                    requests.append(message.text)
                elif message.role is Role.GPT and size < chars:
                    replies.append(message.text)
                    size += len(message.text) + 2
            if size >= chars and len(requests) >= 1000:
                break
        text = "\n\n".join(replies)[:chars]
        return cls(chat, Source(chat, code_text(chars)), Source(chat, text), tuple(requests))

    def count(self, text: str) -> int:
        return len(self.chat.encode(text))

    def counts(self, turns: list[Turn]) -> list[int]:
        """The tokens of each turn's text, tokenized together."""
        found = self.chat.tokenizer([t.text for t in turns], add_special_tokens=False)
        return [len(ids) for ids in found["input_ids"]]


def corpus_chars(config: AgenticConfig) -> int:
    """Enough text that the longest window drawn is a small part of it, up to `CORPUS_CHARS`."""
    longest = max(config.added_tokens.high, config.system_tokens)
    if config.long_prompt is not None:
        longest = max(longest, config.long_prompt.num_tokens)
    return min(CORPUS_CHARS, max(MIN_CORPUS_CHARS, 400 * longest))


def code_text(chars: int) -> str:
    """The `.py` files of `CODE_PACKAGES` in sorted order, each under a line naming it, up to
    `chars` characters."""
    parts, size = [], 0
    for package in CODE_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"the {package} package is not installed")
        root = Path(list(spec.submodule_search_locations)[0])
        for path in sorted(root.rglob("*.py")):
            body = path.read_text(encoding="utf-8", errors="replace")
            parts.append(f"# {package}/{path.relative_to(root).as_posix()}\n{body}")
            size += len(parts[-1])
            if size >= chars:
                return "\n".join(parts)[:chars]
    return "\n".join(parts)


def generate(config: AgenticConfig, corpus: Corpus) -> Workload:
    """The sessions of `config`: the same for the same config, corpus and tokenizer."""
    rng = random.Random(config.seed)
    system = system_prompt(corpus, config.system_tokens, rng)
    num_system = corpus.count(system)
    overhead = _TemplateCost.measure(corpus.chat)
    # recorded replies and the long prompt draw from streams of their own, so that the
    # sessions under a seed stay the same with or without them
    recorded = random.Random(f"{config.seed}:replies")
    sessions = tuple(
        _session(f"s{i}", config, corpus, (rng, recorded), num_system, overhead)
        for i in range(config.num_sessions)
    )
    long_prompt = None
    if config.long_prompt is not None:
        drawn = random.Random(f"{config.seed}:long-prompt")
        long_prompt = corpus.text.window(drawn, config.long_prompt.num_tokens)
    return Workload(config, system, num_system, sessions, long_prompt)


def system_prompt(corpus: Corpus, num_tokens: int, rng: random.Random) -> str:
    """An agent's instructions and its tools' definitions, filled up to `num_tokens` with
    project notes (real text)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": {
                    "type": "object",
                    "properties": {p: {"type": "string"} for p in t.parameters},
                    "required": list(t.parameters),
                },
            },
        }
        for t in TOOLS
    ]
    head = (
        "You are a coding agent working in a software repository. Answer briefly, and call a "
        "tool when you need to see code, run the tests or read documentation. Tool results "
        "come back as <tool_result> messages.\n\n# Tools\n"
        + "\n".join(json.dumps(tool) for tool in tools)
        + "\n\n# Project notes\n"
    )
    room = num_tokens - corpus.count(head)
    if room < 1:
        raise ValueError(
            f"--system-tokens must be more than the tool definitions' {corpus.count(head)}"
        )
    return head + corpus.text.window(rng, room)


@dataclass(frozen=True)
class _TemplateCost:
    """Tokens the chat template adds around the messages: for the system prompt, the first user
    message and the reply's opening; and for each later reply and user message."""

    first: int
    later: int

    @classmethod
    def measure(cls, chat: ChatTokenizer) -> _TemplateCost:
        def cost(messages: list[dict[str, str]]) -> int:
            return len(chat.render(messages)) - sum(
                len(chat.encode(m["content"])) for m in messages
            )

        two = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
        four = [*two, {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]
        first = cost(two)  # type: ignore[arg-type]
        return cls(first, cost(four) - first)  # type: ignore[arg-type]


def _session(
    session_id: str,
    config: AgenticConfig,
    corpus: Corpus,
    rngs: tuple[random.Random, random.Random],  # the sessions', the recorded replies'
    num_system: int,
    overhead: _TemplateCost,
) -> Session:
    rng, recorded = rngs
    mu = math.log(config.turns_mean) - TURNS_SIGMA**2 / 2  # a mean of `turns_mean`
    drawn = []
    for index in range(max(1, round(rng.lognormvariate(mu, TURNS_SIGMA)))):
        tool = None if index == 0 else rng.choices(TOOLS, TOOL_WEIGHTS)[0]
        text = _tool_output(corpus, tool, config.added_tokens.draw(rng), rng)
        pause = rng.expovariate(1 / config.tool_time_s) if config.tool_time_s else 0.0
        name = None if tool is None else tool.name
        max_tokens = config.output_tokens.draw(rng)
        reply = corpus.text.window(recorded, max_tokens)
        drawn.append(Turn(text, 0, max_tokens, name, pause, reply))
    context = num_system + overhead.first
    turns: list[Turn] = []
    for index, (turn, num_tokens) in enumerate(zip(drawn, corpus.counts(drawn), strict=True)):
        cost = num_tokens + turn.max_tokens + (overhead.later if index else 0)
        if context + cost > config.max_context:
            if index == 0:
                raise ValueError(
                    f"--max-context {config.max_context} leaves no room for a first turn after "
                    f"the {num_system}-token system prompt"
                )
            break
        context += cost
        turns.append(dataclasses.replace(turn, num_tokens=num_tokens))
    turns[-1] = dataclasses.replace(turns[-1], tool_time_s=0.0)  # the session ends there
    return Session(session_id, tuple(turns), context)


def _tool_output(corpus: Corpus, tool: Tool | None, num_tokens: int, rng: random.Random) -> str:
    if tool is None:  # the user's request: a whole human message, cut at `num_tokens`
        request = corpus.requests[rng.randrange(len(corpus.requests))]
        ids = corpus.chat.encode(request)
        return request if len(ids) <= num_tokens else corpus.chat.decode(ids[:num_tokens])
    source = corpus.code if tool.source == "code" else corpus.text
    body = source.window(rng, num_tokens)
    return f'<tool_result name="{tool.name}">\n{body}\n</tool_result>'
