"""What every ``rhyme-jax`` command shares: the default config, the ``--config``/``--set`` flags,
help with examples, loading a config with a one-line error, and the errors reported without a
traceback."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

DEFAULT_CONFIG = "configs/default.yaml"

Command = Callable[[argparse.Namespace], int]


def examples_epilog(examples: tuple[str, ...]) -> str | None:
    """A help page's ``examples:`` block (one indented command per line); None without examples."""
    return "examples:\n" + "\n".join(f"  {e}" for e in examples) if examples else None


def add_command(sub, name: str, help_: str, run: Command, *, examples: tuple[str, ...] = (),
                config: bool = True) -> argparse.ArgumentParser:
    """A sub-command ``name`` on the ``rhyme-jax`` subparsers ``sub``: one help line, an
    ``examples:`` epilog, ``--config``/``--set`` unless ``config`` is False; ``run(args) -> exit
    status`` is what ``main`` calls."""
    sp = sub.add_parser(name, help=help_, description=help_, epilog=examples_epilog(examples),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    if config:
        add_config_flags(sp)
    sp.set_defaults(run=run)
    return sp


def add_config_flags(sp: argparse.ArgumentParser, *, set_help: str = "") -> None:
    """``--config FILE`` (default ``configs/default.yaml``) and repeatable ``--set KEY=VALUE``."""
    sp.add_argument("--config", default=DEFAULT_CONFIG, help="YAML run config (default: %(default)s)")
    sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help=set_help or "override a config field, e.g. --set grpo.steps=10 (repeatable)")


def load_run_config(args: argparse.Namespace, required: bool = False):
    """The run config of ``args.config`` + ``args.overrides`` with the checks that need this
    machine (``train.preflight.prepare``), or None after printing the one-line error to stderr.
    ``required``: also refuse a file whose ``???`` keys no ``--set`` gives
    (``config.check_required``; the training commands). Nothing has been computed when it fails."""
    from rhyme_jax.config import ConfigError, check_required, load_config
    from rhyme_jax.train.preflight import prepare

    try:
        if required:
            check_required(args.config, args.overrides)
        return prepare(load_config(args.config, args.overrides))
    except ConfigError as exc:
        print(f"rhyme-jax: config error: {exc}", file=sys.stderr)
        return None


def report(command: str, exc: BaseException) -> int:
    """Print a user error in one line (``rhyme-jax COMMAND: Type: message``); returns the exit
    status (1 for a non-finite loss, a failed run; 2 for bad input)."""
    print(f"rhyme-jax {command}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1 if type(exc).__name__ == "NonFiniteLossError" else 2


def user_errors() -> tuple[type[Exception], ...]:
    """Errors caused by the user's input (config, data, checkpoint, prompts): reported in one
    line instead of a traceback."""
    from rhyme_jax.data import DataError
    from rhyme_jax.model.config import ModelConfigError
    from rhyme_jax.model.hub import ModelImportError
    from rhyme_jax.model.loader import CheckpointFormatError
    from rhyme_jax.model.tokenizer import TokenizerError
    from rhyme_jax.parallel.distributed import DistributedConfigError
    from rhyme_jax.parallel.mesh import MeshConfigError
    from rhyme_jax.parallel.rules import ShardingRuleError
    from rhyme_jax.rollout.engine import EngineConfigError, PromptTooLongError
    from rhyme_jax.io.checkpoint import CheckpointError
    from rhyme_jax.io.summary import PairedEvalError
    from rhyme_jax.train.policy import PolicyConfigError
    from rhyme_jax.train.trainer import NonFiniteLossError, RunExistsError

    return (DataError, ModelConfigError, CheckpointFormatError, TokenizerError, EngineConfigError,
            PromptTooLongError, CheckpointError, PolicyConfigError, NonFiniteLossError,
            RunExistsError, FileNotFoundError, MeshConfigError, ShardingRuleError,
            DistributedConfigError, ModelImportError, PairedEvalError)
