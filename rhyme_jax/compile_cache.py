"""JAX's persistent compilation cache, on by default in the user's cache (``run.compile_cache``).

A rerun or a resume of a run loads its XLA programs from disk instead of compiling them again.
Where the cache lives, first match wins:

* ``$RHYME_JAX_COMPILE_CACHE``: a directory, or ``off``;
* the config's ``run.compile_cache``: a directory, or ``off``;
* default: ``<rhyme-jax cache>/compile_cache`` (``rhyme_jax.model.hub.cache_dir()``:
  ``$RHYME_JAX_CACHE``, else ``$XDG_CACHE_HOME/rhyme_jax``, else ``~/.cache/rhyme_jax``).

``off`` leaves JAX's own settings alone (``JAX_COMPILATION_CACHE_DIR`` still works).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "RHYME_JAX_COMPILE_CACHE"
OFF = ("off", "none", "false", "no", "0")
# Every program is cached: the demo's step programs compile in a fraction of a second each, and
# an entry costs one small file write.
MIN_COMPILE_SECS = 0.0


def resolve(setting: str = "") -> Path | None:
    """The cache directory for a ``run.compile_cache`` value (``""`` = default), or ``None``
    when turned off; ``$RHYME_JAX_COMPILE_CACHE`` wins over the setting."""
    value = os.environ.get(ENV, "").strip() or str(setting or "").strip()
    if value.lower() in OFF:
        return None
    if not value:
        from rhyme_jax.model.hub import cache_dir

        return cache_dir() / "compile_cache"
    return Path(value).expanduser()


def enable(setting: str = "") -> Path | None:
    """Point JAX's persistent compilation cache at ``resolve(setting)`` (created if missing)
    before anything compiles; returns the directory, or ``None`` when off.

    Raises:
      OSError: the directory cannot be created.
    """
    path = resolve(setting)
    if path is None:
        return None
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    cc.reset_cache()  # a cache initialised earlier in this process picks up the new directory
    return path
