"""Count XLA backend compilations (for the no-recompilation tests and the run summary)."""

from __future__ import annotations

import threading

from jax import monitoring

_EVENT = "backend_compile"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Counts JAX backend compilations while registered (a context manager or ``start()``).

    Listens to the ``/jax/core/compile/backend_compile_duration`` monitoring event, which JAX
    records once per program it compiles or loads from the persistent compilation cache
    (in-memory jit cache hits record nothing), and to ``/jax/compilation_cache/cache_hits``.

    Attributes:
      count: backend compile events (compiled + loaded from the persistent cache).
      cache_hits: programs loaded from the persistent cache.
      seconds: wall seconds inside those events (compiling or loading).
    """

    def __init__(self) -> None:
        self.count = 0
        self.cache_hits = 0
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._active = False

    @property
    def compiled(self) -> int:
        """Programs XLA really compiled (not loaded from the persistent cache)."""
        return self.count - self.cache_hits

    def _listener(self, event: str, duration: float, **kwargs) -> None:
        if _EVENT in event:
            with self._lock:
                self.count += 1
                self.seconds += float(duration)

    def _hit_listener(self, event: str, **kwargs) -> None:
        if event == _CACHE_HIT:
            with self._lock:
                self.cache_hits += 1

    def start(self) -> "CompileCounter":
        if not self._active:
            monitoring.register_event_duration_secs_listener(self._listener)
            monitoring.register_event_listener(self._hit_listener)
            self._active = True
        return self

    def stop(self) -> None:
        if self._active:
            monitoring.unregister_event_duration_listener(self._listener)
            monitoring.unregister_event_listener(self._hit_listener)
            self._active = False

    def stats(self) -> dict:
        """``{"compiled", "loaded_from_cache", "seconds"}`` so far (for run summaries)."""
        return {"compiled": self.compiled, "loaded_from_cache": self.cache_hits, "seconds": round(self.seconds, 2)}

    def __enter__(self) -> "CompileCounter":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
