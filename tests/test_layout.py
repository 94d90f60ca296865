"""The shape of the product and the lab: layers import only downwards, the product
(``rhyme_jax``) never imports the lab (``rhyme_lab``), no import circle, and no function is over
80 lines.

The function-length rule covers ``rhyme_jax/``, ``rhyme_lab/``, ``pallas_kernels/`` and
``benchmarks/`` (``LENGTH_RULE_TREES``); a function's length counts its whole ``def`` including
the docstring.

Product floors (ground first): ``io`` / ``config``; ``model``, ``data``, ``parallel``;
``rollout``; ``spec``; ``sched``; ``train``; the CLI package (``rhyme_jax/cli/``) on top.
``config`` imports only the standard library, YAML/OmegaConf and itself; no module edits
``sys.path`` (nor does a benchmark entry point), and no test loads a benchmark file.
``model``, ``rollout``, ``spec``, ``parallel`` and ``data`` never import ``train``; ``sched``
never imports ``train``; ``spec`` never imports ``rollout`` (the engine owns draft bucketing).
Lab floors (above the whole product): ``provenance``, ``analyze``, ``schedule``; ``measure``;
``bench`` and ``ablate`` (neither imports the other); ``cli``. Imports inside functions count too
(they are still dependencies).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "rhyme_jax"
LAB = ROOT / "rhyme_lab"
MAX_FUNCTION_LINES = 80
LENGTH_RULE_TREES = ("rhyme_jax", "rhyme_lab", "pallas_kernels", "benchmarks")

# package -> packages it must never import
FORBIDDEN = {
    "io": {"config", "model", "data", "parallel", "rollout", "spec", "sched", "train", "cli"},
    "model": {"rollout", "spec", "sched", "train", "cli"},
    "data": {"rollout", "spec", "sched", "train", "cli"},
    "parallel": {"rollout", "spec", "sched", "train", "cli"},
    "rollout": {"spec", "sched", "train", "cli"},
    "spec": {"rollout", "sched", "train", "cli"},
    "sched": {"train", "cli"},
    "train": {"cli"},
    "config": {"io", "model", "data", "parallel", "rollout", "spec", "sched", "train",
               "cli", "compile_cache", "compile_count"},
}

# the lab's own floors: package (or module) of rhyme_lab -> what of rhyme_lab it must never import
LAB_FORBIDDEN = {
    "provenance": {"analyze", "schedule", "measure", "bench", "ablate", "cli"},
    "analyze": {"schedule", "measure", "bench", "ablate", "cli"},
    "schedule": {"analyze", "measure", "ablate", "cli"},
    "measure": {"bench", "ablate", "cli"},
    "bench": {"ablate", "cli"},
    "ablate": {"bench", "cli"},
}

# what ``rhyme_jax/config`` may import at all: a YAML file loads with nothing but these
CONFIG_IMPORTS = {"__future__", "dataclasses", "functools", "math", "re", "typing", "pathlib", "yaml", "omegaconf",
                  "rhyme_jax"}


def _modules(pkg: Path = PKG):
    return sorted(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)


def _imported_packages(tree: ast.AST, top: str = "rhyme_jax") -> set[str]:
    """Second component of every ``top.X`` module the tree imports."""
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == top and len(parts) > 1:
                out.add(parts[1])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layers_import_only_downwards(package):
    bad = []
    for path in _modules():
        rel = path.relative_to(PKG)
        if rel.parts[0] != package:
            continue
        hit = _imported_packages(ast.parse(path.read_text())) & FORBIDDEN[package]
        bad += [f"rhyme_jax/{rel} imports rhyme_jax.{h}" for h in sorted(hit)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", sorted(LAB_FORBIDDEN))
def test_lab_layers_import_only_downwards(package):
    bad = []
    for path in _modules(LAB):
        rel = path.relative_to(LAB)
        if rel.parts[0].removesuffix(".py") != package:
            continue
        hit = _imported_packages(ast.parse(path.read_text()), "rhyme_lab") & LAB_FORBIDDEN[package]
        bad += [f"rhyme_lab/{rel} imports rhyme_lab.{h}" for h in sorted(hit)]
    assert not bad, "\n".join(bad)


def test_the_product_never_imports_the_lab():
    """``rhyme_jax`` (what ``pip install`` ships) and ``pallas_kernels`` import nothing of
    ``rhyme_lab`` or ``benchmarks``: the lab reaches a run only through the trainer's callbacks."""
    files = _modules() + _modules(ROOT / "pallas_kernels")
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in files
           for m in sorted(_top_modules(ast.parse(p.read_text())) & {"rhyme_lab", "benchmarks"})]
    assert not bad, "\n".join(bad)
    assert _top_modules(ast.parse("def f():\n    from rhyme_lab.ablate import units\n")) == {"rhyme_lab"}


def _module_graph() -> dict[str, set[str]]:
    """Module name -> the modules of ``rhyme_jax`` / ``rhyme_lab`` it imports (at any depth of
    the file: imports inside functions and under ``TYPE_CHECKING`` count)."""
    names = {}
    for path in _modules() + _modules(LAB):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        names[".".join(parts)] = path
    graph = {}
    for name, path in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps |= {m for m in mods if m in names and not (name + ".").startswith(m + ".")}
        graph[name] = deps  # a module's own packages are imported before it anyway: not edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    """No module of the product or the lab imports, directly or through others, a module that
    imports it back (package ``__init__`` re-exports count as imports)."""
    cycles = _cycles(_module_graph())
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layout_rule_sees_an_upward_import():
    tree = ast.parse("def f():\n    from rhyme_jax.train.optim import make_optimizer\n")
    assert _imported_packages(tree) == {"train"}


def _long_functions(source: str, where: str) -> list[str]:
    """``"where:line name is n lines"`` for every (nested) function of ``source`` over the limit."""
    long = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                long.append(f"{where}:{node.lineno} {node.name} is {n} lines")
    return long


def test_no_function_over_80_lines():
    long = []
    for tree in LENGTH_RULE_TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            if "__pycache__" not in path.parts:
                long += _long_functions(path.read_text(), path.relative_to(ROOT).as_posix())
    assert not long, "\n".join(long)


def test_length_rule_sees_a_long_function():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(f"def f():\n{body}", "k.py") == [f"k.py:1 f is {MAX_FUNCTION_LINES + 1} lines"]
    assert _long_functions(f"def f():\n{body[body.index(chr(10)) + 1:]}", "k.py") == []


def _top_modules(tree: ast.AST) -> set[str]:
    """First component of every module the tree imports (absolute imports)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_config_is_plain_data():
    """Loading a YAML file needs nothing but the YAML file: rhyme_jax/config imports only the
    standard library modules listed, YAML/OmegaConf and itself (machine checks live in
    rhyme_jax/train/preflight.py)."""
    bad = []
    for path in sorted((PKG / "config").glob("*.py")):
        tree = ast.parse(path.read_text())
        extra = _top_modules(tree) - CONFIG_IMPORTS
        inner = {p for p in _imported_packages(tree) if p != "config"}
        bad += [f"rhyme_jax/config/{path.name} imports {m}" for m in sorted(extra | inner)]
    assert not bad, "\n".join(bad)


def test_config_rule_sees_a_machine_import():
    tree = ast.parse("def f():\n    import jax\n    from rhyme_jax.parallel import distributed\n")
    assert _top_modules(tree) - CONFIG_IMPORTS == {"jax"}
    assert _imported_packages(tree) == {"parallel"}


def _edits_sys_path(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
                and node.value.id == "sys":
            return True
    return False


# the one module allowed: a user's reward module (``reward.fn``) is imported from the working
# directory, which the ``rhyme-jax`` console script does not put on sys.path (``python -m`` does)
SYS_PATH_ALLOWED = {"data/custom_reward.py"}


def test_no_sys_path_edits_in_the_package():
    """Neither the package nor a benchmark entry point (``python -m benchmarks.NAME``) edits
    ``sys.path``."""
    files = [p for p in _modules() if p.relative_to(PKG).as_posix() not in SYS_PATH_ALLOWED]
    files += sorted((ROOT / "benchmarks").glob("*.py"))
    bad = [str(p.relative_to(ROOT)) for p in files if _edits_sys_path(ast.parse(p.read_text()))]
    assert not bad, "modules touching sys.path: " + ", ".join(bad)
    assert _edits_sys_path(ast.parse("import sys\nsys.path.insert(0, 'x')\n"))


def _loads_a_benchmark(tree: ast.AST) -> bool:
    """The tree imports ``benchmarks`` or loads a file by path (``spec_from_file_location``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "benchmarks" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "benchmarks":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "spec_from_file_location":
            return True
    return False


def test_tests_import_the_library_not_benchmark_files():
    """Tests import library code; a whole benchmark runs only as ``python -m benchmarks.NAME``."""
    bad = [p.name for p in sorted((ROOT / "tests").glob("*.py")) if _loads_a_benchmark(ast.parse(p.read_text()))]
    assert not bad, "tests loading benchmark files: " + ", ".join(bad)
    assert _loads_a_benchmark(ast.parse("from benchmarks import schedule\n"))
    assert _loads_a_benchmark(ast.parse("import importlib.util\nimportlib.util.spec_from_file_location('b', 'x')\n"))


def _engine_private_names() -> set[str]:
    """Underscore attributes the ``RolloutEngine`` class defines (methods and ``self._x`` fields)."""
    tree = ast.parse((PKG / "rollout" / "engine.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RolloutEngine")
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")
             and not n.name.startswith("__")}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            names.add(node.attr)
    return names


def test_no_private_engine_name_outside_rollout():
    """The engine's public API (``warmup``, ``runner``, ``generate``, ``profile_pass_cost``, ...)
    is all the trainer, ``ablate/``, the CLI and the benchmarks use."""
    private = _engine_private_names()
    assert {"_run", "_ensure_pool", "_flat_state", "_call"} <= private
    files = [p for p in _modules() if p.relative_to(PKG).parts[0] != "rollout"]
    files += sorted((PKG.parent / "benchmarks").glob("*.py"))
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                bad.append(f"{path.relative_to(PKG.parent)}:{node.lineno} .{node.attr}")
    assert not bad, "\n".join(bad)


def test_architecture_doc_shows_the_product_in_200_lines_and_the_lab_apart():
    """docs/architecture.md: the product's part (before "## The lab") is at most 200 lines and
    names every package and top-level module of ``rhyme_jax``; the lab's section names every
    package of ``rhyme_lab``."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    product, sep, lab = text.partition("\n## The lab: `rhyme_lab/`")
    assert sep, "docs/architecture.md has no '## The lab: `rhyme_lab/`' section"
    assert len(product.splitlines()) <= 200, len(product.splitlines())
    for path in sorted(PKG.iterdir()):
        if path.name.startswith("_") or path.name == "__pycache__":
            continue
        name = path.name + "/" if path.is_dir() else path.name
        assert f"`{name}" in product or f"`rhyme_jax/{name}" in product, name
    for path in sorted(LAB.iterdir()):
        if path.is_dir() and not path.name.startswith("_"):
            assert f"rhyme_lab/{path.name}/" in lab, path.name
