"""Count XLA backend compilations (for the no-recompilation tests and the run summary)."""

from __future__ import annotations

import threading

from jax import monitoring

_EVENT = "backend_compile"


class CompileCounter:
    """Counts JAX backend compilations while registered (a context manager or ``start()``).

    Listens to the ``/jax/core/compile/backend_compile_duration`` monitoring event, which JAX
    records once per XLA compilation (cache hits record nothing).
    """

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._active = False

    def _listener(self, event: str, duration: float, **kwargs) -> None:
        if _EVENT in event:
            with self._lock:
                self.count += 1

    def start(self) -> "CompileCounter":
        if not self._active:
            monitoring.register_event_duration_secs_listener(self._listener)
            self._active = True
        return self

    def stop(self) -> None:
        if self._active:
            monitoring.unregister_event_duration_listener(self._listener)
            self._active = False

    def __enter__(self) -> "CompileCounter":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
