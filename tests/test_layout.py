"""The layout's rules, read from the imports of every product module (DESIGN.md §1):

- `actors/` holds one folder per actor, `wire/` for the protocol between them, and `config.py`;
- dependencies point one way: ops -> actors -> (models, store) -> kernels;
- an actor reaches another only through `wire/` (the few exceptions are named below);
- the engine core (the scheduler but its async shell) imports neither torch, nats nor asyncio,
  directly or through any project module;
- nats is imported by the bus and by JetStream's module alone, OpenTelemetry configured by one
  module; only `store/` imports lmdb; only `kernels/` holds Triton kernels.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "kernels", "models", "ops", "store")
ACTORS = ("wire", "ingress", "tokenizer", "planner", "scheduler", "executor")
# the scheduler's async shell: the rest of actors/scheduler/ is the engine core
SCHEDULER_SHELL = {
    "actor",
    "engine_thread",
    "sweeper",
    "remote_runner",
    "remote_disk",
    "ownership",
    "load_reporter",
}
# an actor that uses another's sans-I/O core in its own process, on purpose
CROSSINGS = {
    # the reply text is found on the engine thread when no tokenizer actor runs elsewhere
    ("scheduler", "tokenizer"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("pensieve", *parts))


@functools.cache
def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


@functools.cache
def _imports(module: str) -> frozenset[str]:
    """Every module `module` imports, at any depth of its code (lazy imports count too)."""
    path = _modules()[module]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and not node.level:
            found.add(node.module)
            # `from pensieve.actors.wire import bus` imports the module pensieve.actors.wire.bus
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return frozenset(
        name for name in found if not name.startswith("pensieve") or name in _modules()
    )


def _project(module: str) -> frozenset[str]:
    return frozenset(name for name in _imports(module) if name.startswith("pensieve."))


@functools.cache
def _reach(module: str) -> frozenset[str]:
    """`module` and every project module it imports, directly or not."""
    seen = {module}
    todo = [module]
    while todo:
        for name in _project(todo.pop()):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return frozenset(seen)


def _external(modules: frozenset[str]) -> set[str]:
    return {
        name.split(".")[0]
        for module in modules
        for name in _imports(module)
        if not name.startswith("pensieve")
    }


def _package(module: str) -> str:
    return module.split(".")[1]


def _actor(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[1] == "actors" and len(parts) > 3 else None


def _importers(name: str) -> set[str]:
    return {
        module
        for module in _modules()
        if any(i == name or i.startswith(name + ".") for i in _imports(module))
    }


def test_actors_holds_one_folder_per_actor_and_the_config() -> None:
    entries = {p.name for p in (ROOT / "actors").iterdir() if p.name != "__pycache__"}
    assert entries == {*ACTORS, "config.py", "__init__.py"}
    for actor in ACTORS:
        assert (ROOT / "actors" / actor / "__init__.py").exists(), actor


def test_dependencies_point_from_ops_to_actors_to_models_and_store_to_kernels() -> None:
    below = {
        "ops": set(PACKAGES),
        "actors": {"actors", "models", "store", "kernels"},
        "models": {"models", "kernels"},
        "store": {"store", "models", "kernels"},
        "kernels": {"kernels"},
    }
    wrong = {
        (module, name)
        for module in _modules()
        for name in _project(module)
        if _package(name) not in below[_package(module)]
    }
    assert not wrong, sorted(wrong)


def test_an_actor_reaches_another_only_through_the_wire() -> None:
    wrong = set()
    for module in _modules():
        actor = _actor(module)
        if actor is None:
            continue
        for name in _project(module):
            other = _actor(name)
            if other not in (None, actor, "wire") and (actor, other) not in CROSSINGS:
                wrong.add((module, name))
            if actor == "wire" and other not in (None, "wire"):
                wrong.add((module, name))
    assert not wrong, sorted(wrong)


def test_the_engine_core_imports_neither_torch_nor_nats_nor_asyncio() -> None:
    core = [
        module
        for module in _modules()
        if module.startswith("pensieve.actors.scheduler.")
        and module.split(".")[-1] not in SCHEDULER_SHELL
    ]
    assert "pensieve.actors.scheduler.engine" in core
    for module in core:
        reached = _reach(module)
        shells = {m for m in reached if m.split(".")[-1] in SCHEDULER_SHELL}
        assert not shells, (module, shells)
        assert not _external(reached) & {"torch", "nats", "asyncio", "triton"}, (
            module,
            sorted(m for m in reached if _external(frozenset({m})) & {"torch", "nats", "asyncio"}),
        )


def test_one_module_each_speaks_nats_and_configures_telemetry() -> None:
    assert _importers("nats") == {"pensieve.actors.wire.bus", "pensieve.actors.wire.jetstream"}
    assert _importers("opentelemetry.sdk") == {"pensieve.ops.telemetry"}
    assert {_package(m) for m in _importers("lmdb")} == {"store"}


def test_only_kernels_hold_triton_kernels_and_kernels_import_no_project_module() -> None:
    jitted = {
        module
        for module, path in _modules().items()
        if "@triton.jit" in path.read_text() or "@triton.autotune" in path.read_text()
    }
    assert jitted and {_package(m) for m in jitted} == {"kernels"}
    kernels = [m for m in _modules() if _package(m) == "kernels"]
    assert all(_package(name) == "kernels" for m in kernels for name in _project(m))
