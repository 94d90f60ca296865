"""The ``rhyme-jax`` command line: one module per command group, shared helpers in ``common``.

``main`` (the console script) builds the parser from every command module's ``register`` and
runs the chosen command. ``python -m rhyme_jax.cli`` is the same entry point. Nothing in the
package imports this package back.
"""

from rhyme_jax.cli.main import main

__all__ = ["main"]
