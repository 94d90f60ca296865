"""The README and docs/ stay true to the code: every ``rhyme-jax`` (and ``python -m rhyme_lab``)
command in a ```bash block parses with the real CLI parser, every ``configs/...`` file they name exists, and every relative
Markdown link points at a file of the repository."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rhyme_jax.cli.main import parser
from rhyme_lab.cli.main import parser as lab_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def _bash_commands(text: str) -> list[str]:
    """``rhyme-jax ...`` and ``python -m rhyme_lab ...`` (as ``rhyme_lab ...``) command lines of the ```bash blocks (continuations joined, comments and
    leading ``VAR=value`` assignments dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            for part in line.split("&&"):
                words = shlex.split(part)
                while words and ENV.match(words[0]):
                    words = words[1:]
                if words[:3] == ["python", "-m", "rhyme_lab"]:
                    words = ["rhyme_lab", *words[3:]]
                if words and words[0] in ("rhyme-jax", "rhyme_lab"):
                    out.append(" ".join(shlex.quote(w) for w in words))
    return out


COMMANDS = [(page.name, cmd) for page in PAGES for cmd in _bash_commands(page.read_text())]


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 10 and any(name == "README.md" for name, _ in COMMANDS)


@pytest.mark.parametrize("page,command", COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_every_documented_command_parses(page, command):
    prog, *args = shlex.split(command)
    try:
        (parser() if prog == "rhyme-jax" else lab_parser()).parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"{page}: `{command}` does not parse (exit {exc.code})")
    for word in args:
        if word.startswith("configs/") and word.endswith(".yaml"):
            assert (REPO / word).is_file(), f"{page}: `{command}` names a missing {word}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page):
    bad = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        if not (page.parent / target).exists():
            bad.append(target)
    assert not bad, f"{page.name}: broken links {bad}"


def test_the_command_extractor_sees_continuations_and_env():
    text = "```bash\nA=1 B=2 rhyme-jax train --config configs/x.yaml \\\n  --dry-run  # note\n```\n"
    assert _bash_commands(text) == ["rhyme-jax train --config configs/x.yaml --dry-run"]
    lab = "```bash\npython -m rhyme_lab ablate paper --quick\n```\n"
    assert _bash_commands(lab) == ["rhyme_lab ablate paper --quick"]
