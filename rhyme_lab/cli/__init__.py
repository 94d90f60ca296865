"""``python -m rhyme_lab``: the lab's command line, one module per command (``ablate``, ``analyze``,
``replay``), built on the product CLI's shared helpers (``rhyme_jax.cli.common``)."""
