"""The configuration reference (docs/config.md), generated from the config dataclasses.

Every key of ``RunConfig`` gets one table row: its dotted key, type, default, range or choices
and one line of meaning. Nothing is written by hand:

* type and default come from the dataclass fields (``Literal[...]`` choices: ``checks.literal_choices``);
* the range comes from the section's ``__post_init__`` (and the module functions it calls with
  ``self``), read with ``ast``: ``at_least(self, N, "name", ...)`` gives ``>= N``,
  ``above(self, N, ...)`` gives ``> N``, ``fail(self, "name", "must be in [a, b] ...")`` gives
  ``[a, b]`` (``must be ...`` and ``must divide ...`` messages only);
* the meaning is the field's ``# comment`` in the source: the trailing comment of its line, the
  comment lines right above it (when its line has none) and comment lines continuing it.

Regenerate after changing a section: ``python -m rhyme_lab.config_reference --write``
(``--check`` exits 1 when docs/config.md is stale; no option prints the page). A developer's
tool, so it lives in the lab, not the installed package: it reads the config package's source.
``tests/test_docs_reference.py`` fails when the page is stale or a field has no comment.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import inspect
import io
import re
import sys
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any, NamedTuple

from rhyme_jax.config.checks import field_types, literal_choices
from rhyme_jax.config.run_config import RunConfig

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "config.md"
REGENERATE = "python -m rhyme_lab.config_reference --write"
_BOUND_CALLS = {"at_least": ">=", "above": ">"}


class Row(NamedTuple):
    """One key of the reference: dotted key, type, default, range / choices, meaning (all text)."""

    key: str
    type: str
    default: str
    range: str
    meaning: str


class Section(NamedTuple):
    """One table: the section's dotted key, its docstring's first paragraph and its rows."""

    key: str
    doc: str
    rows: list[Row]


# ----------------------------------------------------------------------------- source reading
@functools.lru_cache(maxsize=None)
def _module_source(module_name: str) -> tuple[ast.Module, dict[int, str], frozenset[int]]:
    """A module's AST, its comments by line number, and the lines holding only a comment."""
    source = inspect.getsource(importlib.import_module(module_name))
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in skip:
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    return ast.parse(source), comments, frozenset(set(comments) - code_lines)


def _class_node(cls: type) -> ast.ClassDef:
    tree = _module_source(cls.__module__)[0]
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node
    raise LookupError(f"class {cls.__name__} not found at the top level of {cls.__module__}")


def field_comments(cls: type) -> dict[str, str]:
    """The ``# comment`` text of each dataclass field of ``cls`` ('' when it has none).

    A field's text is its line's trailing comment plus the comment-only lines attached to it: a
    block of comment lines right above a field whose line has no trailing comment belongs to that
    field; a block right below a field that is not followed by such a field continues it.
    """
    _, comments, only = _module_source(cls.__module__)
    names = {f.name for f in dataclasses.fields(cls)}
    stmts = [s for s in _class_node(cls).body if not isinstance(s, ast.Expr)]
    parts: dict[str, list[int]] = {}
    for stmt in stmts:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id in names:
            parts[stmt.target.id] = [ln for ln in range(stmt.lineno, stmt.end_lineno + 1) if ln in comments]
    by_start = {s.lineno: s for s in stmts}
    by_end = {s.end_lineno: s for s in stmts}
    for start, end in _blocks(sorted(only)):
        below, above = by_start.get(end + 1), by_end.get(start - 1)
        owner = None
        if _field_name(below, names) and not parts[below.target.id]:
            owner = below.target.id
        elif _field_name(above, names):
            owner = above.target.id
        if owner is not None:
            parts[owner].extend(range(start, end + 1))
    return {name: " ".join(comments[ln] for ln in sorted(parts.get(name, []))).strip() for name in names}


def _field_name(stmt: ast.stmt | None, names: set[str]) -> str | None:
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id in names:
        return stmt.target.id
    return None


def _blocks(lines: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive line numbers as ``(first, last)``."""
    out: list[tuple[int, int]] = []
    for ln in lines:
        if out and out[-1][1] == ln - 1:
            out[-1] = (out[-1][0], ln)
        else:
            out.append((ln, ln))
    return out


# ----------------------------------------------------------------------------- ranges
def field_ranges(cls: type) -> dict[str, list[str]]:
    """Bounds of the fields of ``cls`` found in its ``__post_init__`` (and in the module-level
    functions it calls with ``self`` first): ``{"steps": [">= 1"], "top_p": ["(0, 1]"]}``."""
    out: dict[str, list[str]] = {}
    post = next((n for n in _class_node(cls).body
                 if isinstance(n, ast.FunctionDef) and n.name == "__post_init__"), None)
    if post is None:
        return out
    module = importlib.import_module(cls.__module__)
    funcs = {n.name: n for n in _module_source(cls.__module__)[0].body if isinstance(n, ast.FunctionDef)}
    todo = [(post, post.args.args[0].arg)]
    for call in ast.walk(post):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in funcs \
                and call.args and isinstance(call.args[0], ast.Name) and call.args[0].id == "self":
            helper = funcs[call.func.id]
            todo.append((helper, helper.args.args[0].arg))
    for func, this in todo:
        ctx = _Context(cls.KEY, this, vars(module), _string_bindings(func))
        for call in ast.walk(func):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and len(call.args) >= 3:
                for name, bound in _bounds_of(call, ctx):
                    out.setdefault(name, [])
                    if bound not in out[name]:
                        out[name].append(bound)
    return out


class _Context(NamedTuple):
    key: str  # the section's dotted key
    this: str  # the name ``self`` has in the function
    globals: dict  # the module's namespace (constants such as MAX_DRAFT)
    strings: dict  # local names bound to tuples of field names


def _string_bindings(func: ast.FunctionDef) -> dict[str, list[str]]:
    """Local names bound to a tuple of strings, directly or as a ``for`` loop variable over one."""
    env: dict[str, list[str]] = {}

    def strings(node: ast.AST) -> list[str] | None:
        if isinstance(node, (ast.Tuple, ast.List)) and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            return [e.value for e in node.elts]
        return env.get(node.id) if isinstance(node, ast.Name) else None

    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if (values := strings(node.value)) is not None:
                env[node.targets[0].id] = values
        elif isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            if (values := strings(node.iter)) is not None:
                env[node.target.id] = values
    return env


def _bounds_of(call: ast.Call, ctx: _Context) -> list[tuple[str, str]]:
    """``(field, bound)`` pairs a checks call states: ``at_least``/``above`` or a ``fail``
    whose message starts with ``must be`` / ``must divide``."""
    if not (isinstance(call.args[0], ast.Name) and call.args[0].id == ctx.this):
        return []
    try:
        return _bounds_text(call, ctx)
    except _Unresolved:  # a bound or message built from local values: not stated statically
        return []


class _Unresolved(Exception):
    """An expression ``_render`` cannot turn into text without running the check."""


def _bounds_text(call: ast.Call, ctx: _Context) -> list[tuple[str, str]]:
    name = call.func.id
    if name in _BOUND_CALLS:
        bound = f"{_BOUND_CALLS[name]} {_render(call.args[1], ctx)}"
        return [(n, bound) for arg in call.args[2:] for n in _names(arg, ctx)]
    if name == "fail":
        text = _render(call.args[2], ctx).strip()
        if text.startswith("must be "):
            text = re.sub(r"\s+\([^()]*\)$", "", text[len("must be "):])
            text = text[len("in "):] if text.startswith("in ") else text
        elif text.startswith("must divide "):
            text = "divides " + text[len("must divide "):]
        else:
            return []
        return [(n, text) for n in _names(call.args[1], ctx)]
    return []


def _names(node: ast.AST, ctx: _Context) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name):
        return list(ctx.strings.get(node.id, []))
    return []


def _render(node: ast.AST, ctx: _Context) -> str:
    """Source text of a bound or message: ``self.x`` -> ``<key>.x``, ``self.KEY`` -> the key,
    module constants -> their value; in f-strings ``name={self.name}`` -> ``name``.

    Raises:
      _Unresolved: the expression uses a local name (its value is known only when the check runs).
    """
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == ctx.this:
        return ctx.key if node.attr == "KEY" else f"{ctx.key}.{node.attr}"
    if isinstance(node, ast.Name) and isinstance(ctx.globals.get(node.id), (int, float, str)):
        return str(ctx.globals[node.id])
    if isinstance(node, ast.JoinedStr):
        text = ""
        for part in node.values:
            inner = part.value if isinstance(part, ast.FormattedValue) else part
            is_self = isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) \
                and inner.value.id == ctx.this and inner.attr != "KEY"
            if is_self and text.endswith(f"{inner.attr}="):
                text = text[:-1]  # "spec.pattern_min={self.pattern_min}" -> "spec.pattern_min"
            else:
                text += _render(inner, ctx)
        return text
    if not any(isinstance(n, ast.Name) for n in ast.walk(node)):
        return ast.unparse(node)  # a constant expression such as -1
    raise _Unresolved(ast.unparse(node))


# ----------------------------------------------------------------------------- rows and page
def _type_name(annotation: Any) -> str:
    choices = literal_choices(annotation)
    if choices is not None:
        return type(choices[0]).__name__
    if typing.get_origin(annotation) is not None:  # list[str], dict[str, Any]
        return re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", str(annotation).replace("typing.", ""))  # list[RewardTerm]
    return getattr(annotation, "__name__", str(annotation))


def _value_text(value: Any) -> str:
    """A default as it is written in YAML: strings double-quoted with escapes, booleans lower case."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.encode("unicode_escape").decode("ascii").replace('"', '\\"') + '"'
    return repr(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def _first_paragraph(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("``", "`")


def sections(root: type = RunConfig, prefix: str = "") -> list[Section]:
    """The reference's tables: one per section dataclass under ``root`` (depth first, in field
    order; a dataclass-typed field is its own table after its parent's)."""
    out: list[Section] = []
    for name, annotation in field_types(root).items():
        if not dataclasses.is_dataclass(annotation):
            continue
        key = f"{prefix}{name}"
        comments, ranges = field_comments(annotation), field_ranges(annotation)
        rows, nested = [], []
        types = field_types(annotation)
        for f in dataclasses.fields(annotation):
            if dataclasses.is_dataclass(types[f.name]):
                nested.append(f.name)
                continue
            choices = literal_choices(types[f.name])
            bounds = [", ".join(f"`{c}`" for c in choices)] if choices else []
            bounds += ranges.get(f.name, [])
            rows.append(Row(f"{key}.{f.name}", _type_name(types[f.name]), _value_text(_default(f)),
                            "; ".join(bounds), comments.get(f.name, "")))
        out.append(Section(key, _first_paragraph(annotation), rows))
        if nested:
            out.extend(sections(annotation, f"{key}."))
    return out


def missing_meanings() -> list[str]:
    """Dotted keys whose field has no ``# comment`` in its section's source."""
    return [row.key for sec in sections() for row in sec.rows if not row.meaning]


def _md(text: str) -> str:
    """Table-cell markdown: ``|`` escaped everywhere; outside code spans also ``<``, ``*`` and
    ``_`` at word edges (so ``<run>/sft`` and ``*.safetensors`` show as written). Backslashes
    stay: a comment's ``\\\\boxed`` shows as ``\\boxed``."""
    pieces = text.split("`")
    for i in range(0, len(pieces), 2):  # even pieces are outside code spans
        p = pieces[i].replace("<", "\\<").replace("*", "\\*")
        pieces[i] = re.sub(r"(?<!\w)_|_(?!\w)", r"\\_", p)
    return "`".join(pieces).replace("|", "\\|")


def _cross_checks() -> list[str]:
    """The docstrings of the cross-section checks ``RunConfig.__post_init__`` calls (Raises cut)."""
    module = importlib.import_module(RunConfig.__module__)
    post = next(n for n in _class_node(RunConfig).body
                if isinstance(n, ast.FunctionDef) and n.name == "__post_init__")
    out = []
    for call in ast.walk(post):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and hasattr(module, call.func.id):
            doc = inspect.getdoc(getattr(module, call.func.id)) or ""
            doc = doc.split("\nRaises:")[0].strip().replace("``", "`")
            out.append("- " + textwrap.indent(doc, "  ").lstrip())
    return out


def render() -> str:
    """The text of docs/config.md."""
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from rhyme_jax/config/ by `{REGENERATE}`; do not edit by hand. -->",
        "",
        "Every key of a run configuration (`configs/*.yaml`, `--set key=value`). A YAML file sets any",
        "subset; the rest keep these defaults. Values are checked when the config loads: choices, the",
        "ranges below, finite floats, and the checks across sections at the end; a bad value fails",
        "naming the file and the key. Checks that need the machine (backend, attention kernels,",
        "devices) run when a command starts. A file may mark a value the user must give as `???`",
        "(`configs/gsm8k_qwen2.5_1.5b.yaml`: `model.path: ???`): `train`, `sft`, `demo` and `eval`",
        "then refuse it unless `--set` gives that key; tools that need only shapes read the default.",
        "",
        f"Regenerate after changing `rhyme_jax/config/sections.py`: `{REGENERATE}`.",
        "",
    ]
    for sec in sections():
        lines += [f"## `{sec.key}`", "", _md(sec.doc), "",
                  "| key | type | default | range / choices | meaning |", "|---|---|---|---|---|"]
        for row in sec.rows:
            rng, default = (text.replace("|", "\\|") for text in (row.range, row.default))
            lines.append(f"| `{row.key}` | {row.type} | `{default}` | {rng} | {_md(row.meaning)} |")
        lines.append("")
    lines += ["## Checks across sections", "", "`RunConfig` (rhyme_jax/config/run_config.py) also checks:", ""]
    lines += _cross_checks()
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the reference, write it to docs/config.md (``--write``) or check it (``--check``)."""
    parser = argparse.ArgumentParser(prog="python -m rhyme_lab.config_reference", description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {DOC_PATH}")
    mode.add_argument("--check", action="store_true", help="exit 1 when the file differs from the generated text")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {DOC_PATH}", file=sys.stderr)
    elif args.check:
        current = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.is_file() else ""
        if current != text:
            print(f"{DOC_PATH} is stale; regenerate it: {REGENERATE}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
