"""The package's shape: layers import only downwards, and no function is over 80 lines.

The function-length rule covers ``rhyme_jax/``, ``pallas_kernels/`` and ``benchmarks/``
(``LENGTH_RULE_TREES``); a function's length counts its whole ``def`` including the docstring.

Layer order (ground floor first): ``io`` / ``config``; ``model``, ``data``, ``parallel``;
``rollout``; ``spec``; ``sched``; ``train``; the CLI modules (``rhyme_jax/cli*.py``) on top.
The rules checked are those the architecture issue fixed: ``model``, ``rollout``, ``spec``,
``parallel`` and ``data`` never import ``train``; ``sched`` never imports ``train``; ``spec``
never imports ``rollout`` (the engine owns draft bucketing); the ground floor imports nothing of
rhyme_jax above it. Imports inside functions count too (they are still dependencies).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "rhyme_jax"
MAX_FUNCTION_LINES = 80
LENGTH_RULE_TREES = ("rhyme_jax", "pallas_kernels", "benchmarks")

# package -> packages it must never import
FORBIDDEN = {
    "io": {"config", "model", "data", "parallel", "rollout", "spec", "sched", "train"},
    "model": {"rollout", "spec", "sched", "train"},
    "data": {"rollout", "spec", "sched", "train"},
    "parallel": {"rollout", "spec", "sched", "train"},
    "rollout": {"spec", "sched", "train"},
    "spec": {"rollout", "sched", "train"},
    "sched": {"train"},
}


def _modules():
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _imported_packages(tree: ast.AST) -> set[str]:
    """Second component of every ``rhyme_jax.X`` module the tree imports."""
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "rhyme_jax" and len(parts) > 1:
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
