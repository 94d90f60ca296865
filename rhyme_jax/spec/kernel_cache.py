"""Numba's on-disk cache of the drafting kernels, kept in step with their sources.

Numba keys a cached kernel on its own file's timestamp only: after an update that changes
``calibration.py`` but not ``goodput.py``, ``goodput.draft_kernel`` would keep running the old
inlined code from ``__pycache__``. ``refresh`` (called when ``rhyme_jax.spec`` is imported, before
any kernel compiles or loads) hashes every kernel source of the package and, when the hash differs
from the stamp beside the cache, deletes the cached kernels (``*.nbi``, ``*.nbc``) and writes the
new stamp; numba then compiles afresh once. Errors (a read-only install) are ignored: numba then
caches elsewhere or not at all.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

KERNEL_SOURCES = ("calibration.py", "candidates.py", "goodput.py", "sam_kernels.py", "self_lookup.py", "siblings.py")
STAMP = "kernel_sources.sha256"


def sources_hash(package: Path) -> str:
    """sha256 over the kernel sources of ``package`` (missing files count as empty)."""
    h = hashlib.sha256()
    for name in KERNEL_SOURCES:
        path = package / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return h.hexdigest()


def refresh(package: Path) -> bool:
    """Drop ``package/__pycache__``'s cached numba kernels if the sources changed since the stamp;
    returns whether it dropped them (False also when nothing could be read or written)."""
    cache = package / "__pycache__"
    stamp = cache / STAMP
    try:
        want = sources_hash(package)
        if stamp.is_file() and stamp.read_text().strip() == want:
            return False
        cache.mkdir(exist_ok=True)
        for f in list(cache.glob("*.nbi")) + list(cache.glob("*.nbc")):
            f.unlink(missing_ok=True)
        tmp = cache / f"{STAMP}.{os.getpid()}.tmp"
        tmp.write_text(want + "\n")
        os.replace(tmp, stamp)
        return True
    except OSError:
        return False
