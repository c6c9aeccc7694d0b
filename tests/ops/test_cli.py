"""The command line: bad input gets one clear line on stderr and exit code 2 (no traceback),
every option explains itself with its default, and the defaults come from one table."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest


def replay(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pensieve.ops.cli", "replay", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def assert_clean_error(done: subprocess.CompletedProcess[str], words: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("pensieve: error:")]
    assert len(lines) == 1 and words in lines[0], done.stderr


def test_missing_file(tmp_path):
    done = replay(str(tmp_path / "nope.json"), "--model", "preset:tiny-llama", "--out", "-")
    assert_clean_error(done, "nope.json")


def test_malformed_records(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "conversations": "not a list"}\n')
    done = replay(str(bad), "--model", "preset:tiny-llama", "--out", "-")
    assert_clean_error(done, "bad.jsonl")


def test_unknown_model(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_bytes(orjson.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"}]}))
    done = replay(str(good), "--model", "no-such-model", "--out", "-")
    assert_clean_error(done, "no-such-model")


@pytest.mark.slow
def test_context_longer_than_the_model_allows(tmp_path):
    long = tmp_path / "long.jsonl"
    message = "word " * 3000  # tiny-llama allows 1024 positions
    long.write_bytes(
        orjson.dumps({"id": "a", "conversations": [{"from": "human", "value": message}]})
    )
    done = replay(str(long), "--model", "preset:tiny-llama", "--out", str(tmp_path / "o.jsonl"))
    assert_clean_error(done, "exceeds the model's context")


def test_every_option_explains_itself_and_shows_its_default() -> None:
    from pensieve.ops.cli import build_parser

    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name in ("serve", "replay"):
        sub = commands.choices[name]
        for action in sub._actions:
            assert action.help, f"pensieve {name} {action.option_strings}: no help text"
        entries = re.split(r"\n(?=  -)", sub.format_help())  # one per option
        for action in sub._actions:
            shown = action.default != argparse.SUPPRESS and type(action.default) in (
                int,
                float,
                str,
            )
            if action.option_strings and shown:
                name = "  " + action.option_strings[0]  # then its metavar or a comma
                (entry,) = [e for e in entries if re.match(re.escape(name) + "[ ,\n]", e)]
                assert f"(default: {action.default})" in " ".join(entry.split()), entry
        groups = {group.title for group in sub._action_groups}
        assert {"model", "cache", "scheduler"} <= groups
    assert {"server"} <= {group.title for group in commands.choices["serve"]._action_groups}


def test_chat_and_bench_help_show_every_option_s_default() -> None:
    """Each option that takes a value says what it is without one ('none' where nothing);
    flags are off unless given."""
    from pensieve.ops.cli import build_parser

    for name in ("chat", "bench"):
        parser = build_parser(name)
        (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        sub = commands.choices[name]
        entries = [" ".join(e.split()) for e in re.split(r"\n(?=  -)", sub.format_help())]
        for action in sub._actions:
            hidden = action.help == argparse.SUPPRESS
            if not action.option_strings or action.nargs == 0 or hidden:  # a flag, --help
                continue
            (entry,) = [e for e in entries if e.startswith(action.option_strings[0] + " ")]
            assert "default" in entry, f"pensieve {name}: {entry}"


# per actor: options its help lists, and options of other actors that it must not list
ACTOR_HELP = {
    "executor": (
        {"--model", "--device", "--dtype", "--gpu-cache-tokens", "--cpu-threads", "--block-size"}
        | {"--disk-cache-dir", "--disk-cache-gb", "--disk-read-gbps"},
        {"--max-batch-tokens", "--tokenizers", "--metrics-port", "--http-port", "--turn-log"},
    ),
    "scheduler": (
        {"--model", "--dtype", "--max-batch-tokens", "--tokenizers", "--metrics-port", "--policy"},
        {"--device", "--gpu-cache-tokens", "--cpu-threads", "--http-port", "--disk-cache-dir"},
    ),
    "tokenizer": (
        {"--model", "--tokenizer", "--chat-template", "--tokenizers"},
        {"--device", "--dtype", "--max-batch-tokens", "--block-size", "--http-port"},
    ),
    "recompute-planner": (
        {"--block-size"},
        {"--model", "--device", "--dtype", "--max-batch-tokens", "--http-port", "--tokenizers"},
    ),
    "ingress": (
        {"--turn-log"},
        {"--model", "--device", "--dtype", "--block-size", "--http-port", "--max-waiting"},
    ),
    "http": (
        {"--model", "--http-port", "--http-host", "--served-model-name", "--shutdown-grace"},
        {"--device", "--dtype", "--tokenizers", "--block-size", "--max-batch-tokens"},
    ),
}
# every actor's: where the actors meet and who they are there, the store, logs and traces
EVERY_ACTOR = {"--nats-url", "--data-dir", "--nats-user", "--trace", "--log-level"}


def test_each_actor_s_help_lists_its_options_alone_and_it_refuses_another_s(capsys) -> None:
    """An actor starts no nats-server: it has no --nats-port, and --nats-url is required; an
    option of `pensieve serve` that it does not use is refused with a line naming it."""
    from pensieve.ops.cli import build_parser, main
    from pensieve.ops.cli_actor import ACTOR_NAMES, TAKEN_BY

    assert set(ACTOR_HELP) == set(ACTOR_NAMES)
    for name, (own, others) in ACTOR_HELP.items():
        with pytest.raises(SystemExit):
            build_parser("actor").parse_args(["actor", name, "--help"])
        listed = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", capsys.readouterr().out))
        assert own | EVERY_ACTOR <= listed, (name, own - listed)
        assert not listed & (others | {"--nats-port", "--step-channel", "--insecure"}), name
    url = ["--nats-url", "nats://127.0.0.1:1"]
    for name, option, value, takers in (
        ("ingress", "--device", "cuda", "`pensieve actor executor` takes it"),
        ("executor", "--max-batch-tokens", "64", "`pensieve actor scheduler` takes it"),
        ("http", "--dtype", "float16", "the executor and scheduler actors take it"),
        ("scheduler", "--step-channel", "nats", "`pensieve serve` takes it"),
        ("scheduler", "--disk-cache-dir", "/tmp", "`pensieve actor executor` takes it"),
        ("recompute-planner", "--no-prefix-sharing", None, "`pensieve actor scheduler` takes it"),
    ):
        given = [option] if value is None else [option, value]
        with pytest.raises(SystemExit) as exited:
            main(["actor", name, *url, *given])
        err = capsys.readouterr().err
        assert exited.value.code == 2, err
        assert f"{option} does not apply to `pensieve actor {name}`: {takers}" in err, err
    # the actors that load the model need it; an actor not given --nats-url is refused
    for name, words in (("scheduler", "--model"), ("ingress", "--nats-url")):
        with pytest.raises(SystemExit):
            main(["actor", name])
        err = capsys.readouterr().err
        assert "the following arguments are required" in err and words in err, err
    # what an actor does not take keeps its default for the options it is built from
    args = build_parser().parse_args(["actor", "ingress", *url])
    assert (args.device, args.block_size, args.overlap, args.model) == ("cpu", 32, True, None)
    assert set(TAKEN_BY) <= set(vars(args))  # the table names options that exist


def test_the_defaults_come_from_one_table() -> None:
    from pensieve.actors.config import DEFAULTS, CacheConfig, SchedulerConfig
    from pensieve.ops.cli import build_parser
    from pensieve.ops.context import ServeOptions
    from pensieve.ops.engine_options import EngineOptions

    args = build_parser().parse_args(["serve", "--model", "smollm2"])
    options = EngineOptions(model="smollm2")
    cache, scheduling = CacheConfig(), SchedulerConfig()
    assert args.max_batch_tokens == options.max_batch_tokens == DEFAULTS.max_batch_tokens
    assert scheduling.max_num_batched_tokens == DEFAULTS.max_batch_tokens
    assert args.max_num_seqs == options.max_num_seqs == scheduling.max_num_seqs
    assert args.admit_batch == options.admit_batch == scheduling.admit_batch
    assert args.admission_reserve == options.admission_reserve == cache.admission_reserve
    assert args.swap_out_threshold == options.swap_out_threshold == cache.swap_out_threshold
    assert args.block_size == options.block_size == cache.block_size == DEFAULTS.block_size
    assert args.nats_port == DEFAULTS.nats_port and args.max_waiting == DEFAULTS.max_waiting
    assert args.tokenizers == ServeOptions(Path("data")).tokenizers == DEFAULTS.tokenizers
    with pytest.raises(ValueError, match="--tokenizers"):
        ServeOptions(Path("data"), tokenizers=-1)
    expiry = ServeOptions(Path("data")).expiry
    assert args.conversation_ttl == expiry.conversation_ttl_s == DEFAULTS.conversation_ttl_s
    assert args.stateless_ttl == expiry.stateless_ttl_s == DEFAULTS.stateless_ttl_s


def test_the_expiry_options_reach_the_server() -> None:
    from pensieve.ops.cli import build_parser
    from pensieve.ops.cli_options import serve_options

    argv = ["serve", "--model", "smollm2", "--conversation-ttl", "600", "--stateless-ttl", "30"]
    expiry = serve_options(build_parser().parse_args(argv)).expiry
    assert (expiry.conversation_ttl_s, expiry.stateless_ttl_s) == (600, 30)
    assert expiry.sweep_interval_s == 3  # a tenth of the shorter TTL
    with pytest.raises(ValueError, match="--stateless-ttl"):
        serve_options(build_parser().parse_args([*argv, "--stateless-ttl", "0"]))


def test_the_http_limits_reach_the_server() -> None:
    from pensieve.actors.config import DEFAULTS
    from pensieve.ops.cli import build_parser
    from pensieve.ops.cli_options import serve_options

    argv = ["serve", "--model", "smollm2", "--http-port", "8000"]
    http = serve_options(build_parser().parse_args(argv)).http
    assert http is not None and http.read_timeout_s == DEFAULTS.http_read_timeout_s
    assert http.max_connections == DEFAULTS.http_max_connections
    limited = [*argv, "--http-read-timeout", "2.5", "--http-max-connections", "7"]
    http = serve_options(build_parser().parse_args(limited)).http
    assert http is not None and (http.read_timeout_s, http.max_connections) == (2.5, 7)
    for flag, bad in (("--http-read-timeout", "0"), ("--http-max-connections", "0")):
        with pytest.raises(ValueError, match=flag):
            serve_options(build_parser().parse_args([*argv, flag, bad]))


def test_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pensieve.ops.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and re.fullmatch(r"pensieve \S+\n", done.stdout), done


def _imported(*args: str) -> set[str]:
    """The modules `python -m pensieve.ops.cli ARGS` imports (python -X importtime)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pensieve.ops.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    return {line.rsplit("|", 1)[1].strip() for line in lines}


def test_version_and_help_import_no_torch_nor_anything_a_command_needs() -> None:
    """`pensieve --version` and `--help` build the parser without torch or transformers (which
    take seconds to import), and without what a command's options need; a command's own help
    imports no torch either, nor does the whole parser."""
    heavy = {"torch", "transformers"}
    for args in (["--version"], ["--help"]):
        imported = _imported(*args)
        assert not imported & (heavy | {"nats", "tqdm", "lmdb"}), (args, imported & heavy)
    for command in ("serve", "actor", "replay", "tenant", "chat", "bench"):
        assert not _imported(command, "--help") & heavy, command
    whole = (
        "import sys; from pensieve.ops.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", whole], capture_output=True, text=True)
    assert done.stdout.strip() == "[]", done.stderr[-2000:]


def test_the_actor_names_of_the_parser_are_those_deployed() -> None:
    from pensieve.ops.cli_actor import ACTOR_NAMES
    from pensieve.ops.deploy import ACTORS

    assert tuple(ACTORS) == ACTOR_NAMES


def test_a_taken_nats_port_is_a_clear_error_before_the_model_loads(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        begin = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pensieve.ops.cli",
                "serve",
                "--model",
                "smollm2",
                "--data-dir",
                str(tmp_path),
                "--nats-port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert_clean_error(done, f"port {port} is taken")
    assert "--nats-url" in done.stderr and "model smollm2 loaded" not in done.stderr
    assert time.monotonic() - begin < 60


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    from pensieve.ops.nats_server import free_port

    command = [sys.executable, "-m", "pensieve.ops.cli", "serve", "--nats-port", str(free_port())]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300)


def test_taken_http_and_metrics_ports_are_clear_errors_before_the_model_loads(tmp_path) -> None:
    """As a taken --nats-port: the option named, no model loaded, nothing written."""
    data = tmp_path / "data"
    model = ["--model", "smollm2", "--data-dir", str(data)]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for flag in ("--http-port", "--metrics-port"):
            done = serve(*model, flag, port)
            assert_clean_error(done, f"{flag} {port}: the port is taken")
            assert "model smollm2 loaded" not in done.stderr and not data.exists()
        actor = [sys.executable, "-m", "pensieve.ops.cli", "actor", "http", *model]
        done = subprocess.run(
            [*actor, "--nats-url", "nats://127.0.0.1:1", "--http-port", port],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert_clean_error(done, f"--http-port {port}: the port is taken")
    done = serve(*model, "--http-port", port, "--metrics-port", port)
    assert_clean_error(done, f"--http-port and --metrics-port name one port, {port}")


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--gpu-cache-tokens", "-5", "--gpu-cache-tokens must hold 2 blocks at least"),
        ("--gpu-cache-tokens", "40", "--gpu-cache-tokens must hold 2 blocks at least"),
        ("--cpu-cache-tokens", "-1", "--cpu-cache-tokens must be 0 (no CPU tier) or hold"),
        ("--cpu-cache-tokens", "8", "--cpu-cache-tokens must be 0 (no CPU tier) or hold"),
        ("--gpu-cache-gb", "-1", "--gpu-cache-gb must be more than 0"),
        ("--gpu-cache-gb", "0", "--gpu-cache-gb must be more than 0"),
        ("--gpu-cache-gb", "0.00001", "--gpu-cache-gb 1e-05 holds 0 blocks"),
        ("--cpu-cache-gb", "-2", "--cpu-cache-gb must be 0 (no CPU tier) or more"),
        ("--block-size", "24", "--block-size must be a power of two"),
    ],
)
def test_a_cache_size_out_of_range_names_its_option(tmp_path, flag, value, words) -> None:
    done = serve("--model", "smollm2", "--data-dir", str(tmp_path / "data"), flag, value)
    assert_clean_error(done, words)


def test_a_disk_cache_that_cannot_be_used_is_a_clear_error_before_the_model_loads(
    tmp_path,
) -> None:
    model = ["--model", "smollm2", "--data-dir", str(tmp_path / "data")]
    missing = tmp_path / "nowhere"
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    for args, words in (
        (["--disk-cache-dir", str(missing), "--disk-cache-gb", "1"], "does not exist"),
        (["--disk-cache-dir", str(tmp_path)], "give both --disk-cache-dir and --disk-cache-gb"),
        (["--disk-cache-dir", str(tmp_path), "--disk-cache-gb", "0"], "must be more than 0"),
        (
            ["--disk-cache-dir", str(tmp_path), "--disk-cache-gb", "1", "--policy", "gpu-only"],
            "needs prefix sharing and a policy with a CPU tier",
        ),
    ):
        done = serve(*model, *args)
        assert_clean_error(done, words)
        assert "model smollm2 loaded" not in done.stderr
    if os.geteuid() != 0:  # root writes anywhere
        done = serve(*model, "--disk-cache-dir", str(read_only), "--disk-cache-gb", "1")
        assert_clean_error(done, "is not writable")


def test_a_wrong_model_leaves_nothing_behind(tmp_path) -> None:
    """No data dir, store, nats-server files or pid file for a model that does not load, and
    nothing new in a data dir already there."""
    fresh, kept = tmp_path / "fresh", tmp_path / "kept"
    kept.mkdir()
    (kept / "mine.txt").write_text("a file of the user's")
    for data in (fresh, kept):
        done = serve("--model", str(tmp_path / "no-such-model"), "--data-dir", str(data))
        assert_clean_error(done, "model not found")
    assert not fresh.exists()
    assert [p.name for p in kept.iterdir()] == ["mine.txt"]


@pytest.mark.slow
def test_serve_takes_its_model_and_port_as_vllm_serve_does(tmp_path) -> None:
    """`pensieve serve MODEL --host H --port P`: the OpenAI API of that model on H:P, as
    `vllm serve` would serve it (and --max-num-batched-tokens, vLLM's name of a step's tokens)."""
    import aiohttp

    from pensieve.ops.nats_server import free_port

    port = free_port()
    command = [sys.executable, "-m", "pensieve.ops.cli", "serve", "smollm2", "--insecure"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--nats-port", str(free_port())]
    command += ["--data-dir", str(tmp_path / "data"), "--max-num-batched-tokens", "256"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        said = ""
        while "OpenAI-compatible API on" not in said:
            line = proc.stderr.readline()
            assert line, said
            said += line
        assert f"http://127.0.0.1:{port}/v1 (model 'smollm2'" in said, said

        async def models() -> list[str]:
            url = f"http://127.0.0.1:{port}/v1/models"
            async with aiohttp.ClientSession() as session, session.get(url) as response:
                return [m["id"] for m in (await response.json())["data"]]

        assert asyncio.run(models()) == ["smollm2"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_vllm_options_pensieve_spells_otherwise_get_a_line_naming_its_own(capsys) -> None:
    from pensieve.ops.cli import build_parser, main

    args = build_parser().parse_args(["serve", "smollm2", "--max-num-batched-tokens", "256"])
    assert (args.model_word, args.max_batch_tokens) == ("smollm2", 256)
    for option, value, words in (
        ("--gpu-memory-utilization", "0.9", "--gpu-cache-gb GB or --gpu-cache-tokens N"),
        ("--api-key", "k", "pensieve tenant add NAME --out FILE"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(["serve", "smollm2", option, value])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and f"{option} is vLLM's: " in err and words in err, err
    assert main(["serve", "a", "--model", "b"]) == 2
    assert "two models: 'a' and --model 'b'" in capsys.readouterr().err
    assert main(["serve"]) == 2
    assert "pensieve serve MODEL (or --model MODEL)" in capsys.readouterr().err


def test_a_cpu_engine_gets_the_same_threads_in_replay_and_serve() -> None:
    from pensieve.ops.engine_options import EngineOptions
    from pensieve.ops.factory import cpu_threads

    cores = os.cpu_count() or 1
    assert cpu_threads(EngineOptions(model="smollm2")) == max(1, cores - 1)
    assert cpu_threads(EngineOptions(model="smollm2", cpu_threads=3)) == 3
    assert cpu_threads(EngineOptions(model="smollm2", device="cuda")) is None


def test_tensor_parallel_is_spelled_as_vllm_users_expect() -> None:
    from pensieve.ops.cli import build_parser

    parser = build_parser()
    base = ["replay", "x.jsonl", "--out", "-", "--model", "preset:tiny-llama"]
    for flag in ("--tensor-parallel", "--tensor-parallel-size", "-tp"):
        assert parser.parse_args([*base, flag, "2"]).tensor_parallel == 2
    assert parser.parse_args(base).tensor_parallel == 1


def test_kv_heads_that_do_not_split_over_the_ranks_are_a_clear_error(tmp_path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_bytes(orjson.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"}]}))
    done = replay(str(good), "--model", "preset:tiny-llama", "--out", "-", "--tensor-parallel", "3")
    assert_clean_error(done, "2 KV heads do not divide over 3 tensor-parallel ranks")
