"""The rollout weights made once per weight version: the engine's dtype cast and per-layer split,
kept while the weights they came from live.

``RolloutEngine.generate`` runs its passes on a copy of the weights it is given whenever the
engine computes in another dtype (``EngineConfig``'s ``dtype``) or splits the stacked block weights
(``rollout/layer_weights.py``: 60-165 ms a copy for SmolLM2-135M in float32 on 2 CPU cores). One
RL step calls ``generate`` several times on the same weights: once per rollout worker, once per
migrated tail (HistoPipe), again for DAPO's dynamic sampling, for the held-out evaluation. This
cache makes the copy once per weight version and shares it across every engine of the process.

An entry is found by the identity of the source arrays and holds only weak references to them: it
is dropped as soon as one source array is freed or deleted (a donated buffer), so a new weight
version never hits a stale copy and an old one is not kept alive. It holds at most ``capacity``
copies (least recently used dropped first). A state whose preparation copies nothing (the engine
already computes in its dtype, stacked layout) is never cached.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

import jax

from rhyme_jax.model.precision import cast_floating
from rhyme_jax.rollout.layer_weights import split_layers, use_split


class WeightCache:
    """Prepared rollout weights keyed by ``(tag, identity of the source arrays)``.

    Args:
      capacity: copies held at most (each one a full set of weights: SmolLM2-135M split in float32
        is 0.54 GB).

    Attributes:
      made: how many times ``get`` called ``make`` (misses), for tests and benchmarks.
    """

    def __init__(self, capacity: int = 2):
        if capacity < 1:
            raise ValueError(f"WeightCache capacity={capacity}: expected >= 1")
        self.capacity, self.made = capacity, 0
        self._entries: OrderedDict[Hashable, tuple[tuple, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, state: Any, tag: Hashable, make: Callable[[Any], tuple[Any, bool]]) -> Any:
        """``make(state)[0]``, made once while ``state``'s arrays live.

        Args:
          state: a pytree of ``jax.Array`` leaves (the weights a ``generate`` call is given); a tree
            with other leaves (``jax.ShapeDtypeStruct``: lowering) is prepared every time.
          tag: what else the result depends on (the engine's dtype and layer layout).
          make: ``state -> (prepared, copied)``; ``copied`` is False when ``prepared`` is made of
            ``state``'s own arrays (nothing to save, and caching would keep them alive).

        Returns:
          the prepared tree (the cached one on a hit).
        """
        leaves = jax.tree.leaves(state)
        if not leaves or not all(isinstance(x, jax.Array) for x in leaves):
            return make(state)[0]
        key = (tag, tuple(id(x) for x in leaves))
        with self._lock:
            hit = self._lookup(key, leaves)
            if hit is not None:
                return hit
            prepared, copied = make(state)
            self.made += 1
            if copied:
                self._store(key, leaves, prepared)
            return prepared

    def clear(self) -> None:
        """Drop every copy (frees their memory once no ``generate`` call is using them)."""
        with self._lock:
            self._entries.clear()

    def _lookup(self, key, leaves) -> Any:
        entry = self._entries.get(key)
        if entry is None:
            return None
        refs, prepared = entry
        if any(r() is not x or x.is_deleted() for r, x in zip(refs, leaves)):
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return prepared

    def _store(self, key, leaves, prepared) -> None:
        me = weakref.ref(self)

        def forget(_ref, key=key):  # a source array was freed: its copy is stale
            cache = me()
            if cache is not None:
                cache._entries.pop(key, None)

        self._entries[key] = (tuple(weakref.ref(x, forget) for x in leaves), prepared)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


ROLLOUT_WEIGHTS = WeightCache()
"""The process's cache, shared by every ``RolloutEngine``."""


def _prepare(state: Any, dtype, layout: str) -> tuple[Any, bool]:
    run_state = state if dtype is None else cast_floating(state, dtype)
    copied = any(a is not b for a, b in zip(jax.tree.leaves(run_state), jax.tree.leaves(state)))
    if use_split(layout, run_state):
        run_state, copied = split_layers(run_state), True
    return run_state, copied


def rollout_weights(state: Any, dtype, layout: str, cache: WeightCache | None = None) -> Any:
    """The weights a rollout's passes read: ``state`` (a ``Decoder``'s ``nnx.State``) with its
    floating leaves in ``dtype`` (``None``: as they are; ``model.precision.cast_floating``) and,
    when ``layer_weights.use_split(layout, ...)``, in the per-layer layout (``LayerSplit``).

    Made once while ``state``'s arrays live (``cache``, default ``ROLLOUT_WEIGHTS``); the same
    arrays as ``state``'s where nothing needs a copy.

    Raises:
      ValueError: ``layout`` is not one of ``layer_weights.LAYOUTS``.
    """
    cache = ROLLOUT_WEIGHTS if cache is None else cache
    tag = (None if dtype is None else str(jax.numpy.dtype(dtype)), layout)
    return cache.get(state, tag, lambda s: _prepare(s, dtype, layout))


__all__ = ["ROLLOUT_WEIGHTS", "WeightCache", "rollout_weights"]
