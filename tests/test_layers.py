"""The package's layers, enforced: who may import whom (lazy imports inside functions included), and no cycles.

Read from the source with ``ast``, never by importing it, so a violation is found even on a path no test runs:

    targets/  world/  zoo/ (the weight store)  protos/  runtime/core/      import nothing else of the project
    drafters/            targets' types and helpers (never a backend or a loader), runtime/core, the weight store
    runtime/wire/        protos                               (the data-plane protocol: wire and dataplane only)
    runtime/config       runtime/wire (codec names), drafters (drafter names), the weight store (model paths)
    runtime/engine/      core, config, targets, drafters, world, the weight store
    runtime/dataplane/   wire, protos, engine and what it may use
    runtime/serve/       everything of runtime but bench; the only place that imports Ray
    runtime/bench/       everything of runtime
    training/            targets, drafters, runtime/core and runtime/engine, world, the weight store
    specula/cli          everything
    research/            everything (not installed; the product never imports it)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# installed package -> its folder (pyproject.toml's package-dir), plus research/ (not installed)
PACKAGES = {"specula": "specula", "specula.runtime": "runtime", "specula.targets": "targets",
            "specula.drafters": "drafters", "specula.world": "world", "specula.zoo": "zoo", "specula.protos": "protos",
            "specula.training": "training", "research": "research"}

_LOW = {"specula.targets", "specula.world", "specula.zoo", "specula.protos", "specula.runtime.core"}
_ENGINE = {"specula.runtime.core", "specula.runtime.config", "specula.runtime.engine", "specula.targets",
           "specula.drafters", "specula.world", "specula.zoo"}
_RUNTIME = _ENGINE | {"specula.runtime.wire", "specula.runtime.dataplane", "specula.runtime.api_client",
                      "specula.protos"}
ALLOWED: dict[str, set[str]] = {
    **{layer: set() for layer in _LOW | {"specula.runtime"}},
    "specula.drafters": {"specula.targets", "specula.runtime.core", "specula.zoo"},
    "specula.runtime.wire": {"specula.protos"},
    "specula.runtime.config": {"specula.runtime.wire", "specula.drafters", "specula.zoo"},
    "specula.runtime.engine": _ENGINE,
    "specula.runtime.dataplane": _ENGINE | {"specula.runtime.wire", "specula.protos"},
    "specula.runtime.api_client": {"specula.protos"},
    "specula.runtime.serve": _RUNTIME | {"specula.runtime.serve"},
    "specula.runtime.bench": _RUNTIME | {"specula.runtime.serve", "specula.runtime.bench"},
    "specula.training": {"specula.targets", "specula.drafters", "specula.runtime.core", "specula.runtime.engine",
                         "specula.runtime.config", "specula.world", "specula.zoo", "specula.training"},
    "specula.cli": {"*"},
    "research": {"*"},
}
# runtime/'s layers are its sub-packages (and two modules); every other package is one layer
_RUNTIME_LAYERS = ("core", "engine", "wire", "dataplane", "serve", "bench", "config", "api_client")


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            if "_generated" in rel.parts or (pkg == "research" and "tests" in rel.parts):
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def layer(mod: str) -> str:
    parts = mod.split(".")
    if parts[0] == "research":
        return "research"
    if len(parts) == 1 or parts[1] == "cli":
        return "specula.cli"
    if parts[1] == "runtime":
        if len(parts) > 2 and parts[2] in _RUNTIME_LAYERS:
            return f"specula.runtime.{parts[2]}"
        if len(parts) > 2 and parts[2].startswith("config"):  # config.py and its helpers (config_*.py)
            return "specula.runtime.config"
        return "specula.runtime"  # the runtime package's own __init__
    return ".".join(parts[:2])


def imports(mod: str, path: Path, known: set[str]) -> set[str]:
    """Every project module ``mod`` imports, at the top or inside a function; ``from pkg import name`` counts as
    importing ``pkg.name`` where that is a module. ``importlib.import_module("...")`` with a literal counts too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    def add(name: str) -> None:
        if name.startswith(("specula", "research")):
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for a in node.names:
                sub = f"{src}.{a.name}"
                add(sub if sub in known else src)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                add(node.args[0].value)
    found.discard(mod)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports(m, p, known) for m, p in mods.items()}


def test_every_import_follows_the_layers():
    bad = []
    for mod, deps in graph().items():
        mine = layer(mod)
        allowed = ALLOWED.get(mine)
        assert allowed is not None, f"{mod} is in no layer ({mine}); add it to tests/test_layers.py"
        if "*" in allowed:
            continue
        for dep in sorted(deps):
            theirs = layer(dep)
            if theirs != mine and theirs not in allowed:
                bad.append(f"{mod} -> {dep}  ({mine} may not import {theirs})")
            if theirs == "research" and mine != "research":
                bad.append(f"{mod} -> {dep}  (research/ is not installed)")
    assert not bad, "imports across the layers:\n" + "\n".join(bad)


def test_no_import_cycles():
    """Tarjan's strongly connected components over the module graph (package ``__init__`` files are only entered
    when a module names them, not for every submodule import)."""
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # iterative enough for a few hundred modules at recursion depth < 100
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _sources_mentioning(needle: str) -> list[str]:
    return [m for m, p in modules().items() if needle in p.read_text()]


# what drafters may use of targets/: the records that cross the boundary and the cache / image / tree / batching
# helpers
DRAFTER_TARGET_MODULES = {"specula.targets.types", "specula.targets.protocol", "specula.targets.kv",
                          "specula.targets.images", "specula.targets.tree", "specula.targets.batching"}


def test_drafters_use_only_the_targets_types_and_helpers():
    bad = sorted(f"{mod} -> {dep}" for mod, deps in graph().items() if layer(mod) == "specula.drafters"
                 for dep in deps if layer(dep) == "specula.targets" and dep not in DRAFTER_TARGET_MODULES)
    assert not bad, "drafters reaching into the target backends:\n" + "\n".join(bad)


def test_only_serve_imports_ray():
    offenders = []
    for mod, path in modules().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == "ray" or n.startswith("ray.") for n in names) and layer(mod) != "specula.runtime.serve":
                offenders.append(mod)
    assert not offenders, f"Ray imported outside runtime/serve/: {sorted(set(offenders))}"


def test_only_wire_and_dataplane_speak_the_data_plane_protocol():
    speakers = {layer(m) for m in _sources_mentioning('"specula_dataplane"')}
    assert speakers <= {"specula.runtime.wire", "specula.runtime.dataplane", "specula.protos"}, speakers


def test_targets_and_drafters_know_no_ray_or_grpc():
    for mod, path in modules().items():
        if layer(mod) not in ("specula.targets", "specula.drafters"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            assert not any(n.split(".")[0] in ("ray", "grpc") for n in names), f"{mod} imports {names}"


def test_the_checker_sees_lazy_and_from_imports(tmp_path):
    """The walker itself: a lazy import inside a function and ``from pkg import module`` are both edges."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from specula.runtime.engine import loop\n    import specula.zoo.store\n")
    known = {"specula.runtime.engine", "specula.runtime.engine.loop", "specula.zoo", "specula.zoo.store"}
    assert imports("specula.drafters.x", src, known) == {"specula.runtime.engine.loop", "specula.zoo.store"}
    assert layer("specula.runtime.engine.loop") == "specula.runtime.engine"
    assert "specula.runtime.engine" not in ALLOWED["specula.drafters"]
