"""Realized-throughput guard of HistoSpec chunks: run a plain chunk where verify chunks have
emitted fewer tokens per second than decode would.

The chunked engine (``rollout/chunk_spec.py``) sizes a HistoSpec chunk from the host drafter's
estimates, but the device drafts by its own single longest match, and on the ledger task's L5 run
(docs/results.md, "L5 at commit fab1bef") those chunks accepted 0.36 draft tokens a row-pass
where a 64-row verify pass cost 1.6-2.6x a decode pass at the same page-table width: epoch 2 ran
0.82x plain. A chunk of ``r`` live rows that accepts ``g`` draft tokens per row-pass emits
``r (1 + g)`` tokens per verify pass against ``r`` per decode pass, so it pays iff
``(1 + g) * decode_seconds > verify_seconds``. The guard keeps ``g`` and both seconds per pass as
realized (exponential averages over the chunks of one row bucket and page-table width: HistoSpec
chunks for ``g`` and their seconds a pass, plain chunks for decode's) and declines a chunk that
would not pay. Probes back off: the ``PROBE_EVERY``-th declined chunk of a key runs, and each
probe that again does not pay doubles the interval (at most ``MAX_PROBE_EVERY``); one that pays
resets it. The pass-cost model alone was not enough: a verify program of one ``(T, Q)`` pair
has few live times in a rollout, and its profiled cost under the row bucket's live scale priced
verify chunks at about 1.5 decode passes where they ran at 2.7 (the ledger run at 6c5fe19: the
guard declined 4 of the chunks of a step whose HistoSpec rollout ran 0.71x plain). At d10609c,
with realized seconds but a fixed probe every 8th chunk, the probes were most of the HistoSpec
chunks that ran (186 declined, 29 run in one step) at 5x a plain pass each (device drafting over
long histories included): epoch 2 0.86x. Probing lets a key whose acceptance rises (prompts that
gained history) be measured again. Plain and HistoSpec chunks sample the same tokens (the
rollout's per-position streams), so the guard changes time, never tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY = 8  # declined chunks of a key before its first probing HistoSpec chunk
MAX_PROBE_EVERY = 256  # the longest interval between probes after repeated failures
EMA_WEIGHT = 0.5  # weight of the newest chunk in the realized acceptance per row-pass


@dataclass
class SpecGuard:
    """Realized acceptance of HistoSpec chunks per ``(rows, width)``, and the decision it gives.

    Attributes:
      gain: ``(rows, width) -> accepted draft tokens per live row-pass`` (exponential average).
      spec_seconds, plain_seconds: ``(rows, width) -> seconds per pass`` of HistoSpec chunks and
        of plain chunks (exponential averages; ``observe_seconds``).
      declined: ``(rows, width) -> chunks declined since the last HistoSpec chunk of the key``.
      interval: ``(rows, width) -> declined chunks between probes`` (``PROBE_EVERY``, doubling).
      enabled: False runs every chunk the host's choice asks for (ablations).
    """

    gain: dict[tuple[int, int], float] = field(default_factory=dict)
    spec_seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    plain_seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    declined: dict[tuple[int, int], int] = field(default_factory=dict)
    interval: dict[tuple[int, int], int] = field(default_factory=dict)
    enabled: bool = True

    def allows(self, rows: int, width: int, verify_seconds: float, decode_seconds: float) -> bool:
        """Whether a HistoSpec chunk of ``rows`` row bucket at ``width`` pages runs: always for an
        unseen key or a probe (``PROBE_EVERY``), else iff ``(1 + gain) * decode >= verify``, with
        the realized seconds per pass of the key's HistoSpec and plain chunks where it has them,
        else ``verify_seconds`` / ``decode_seconds`` (the engine's ``PassCost`` of the verify
        program the chunk would run and of the decode program, at this width)."""
        key = (int(rows), int(width))
        if not self.enabled or key not in self.gain:
            return True
        verify = self.spec_seconds.get(key, float(verify_seconds))
        decode = self.plain_seconds.get(key, float(decode_seconds))
        if (1.0 + self.gain[key]) * decode >= verify:
            self.declined[key] = 0
            self.interval.pop(key, None)
            return True
        self.declined[key] = self.declined.get(key, 0) + 1
        every = self.interval.get(key, PROBE_EVERY)
        if self.declined[key] >= every:  # a probe; the next one comes twice as late unless this pays
            self.declined[key] = 0
            self.interval[key] = min(2 * every, MAX_PROBE_EVERY)
            return True
        return False

    def observe(self, rows: int, width: int, accepted: int, row_passes: int) -> None:
        """A HistoSpec chunk of ``rows`` at ``width`` accepted ``accepted`` draft tokens over
        ``row_passes`` live row-passes (no-op when it ran none)."""
        if row_passes > 0:
            _average(self.gain, (int(rows), int(width)), float(accepted) / float(row_passes))

    def observe_seconds(self, spec: bool, rows: int, width: int, seconds_per_pass: float) -> None:
        """A chunk's seconds per pass (its call's seconds over the passes it ran), HistoSpec
        (``spec``) or plain, at row bucket ``rows`` and ``width`` pages."""
        _average(self.spec_seconds if spec else self.plain_seconds, (int(rows), int(width)), float(seconds_per_pass))


def _average(table: dict, key: tuple[int, int], value: float) -> None:
    old = table.get(key)
    table[key] = value if old is None else EMA_WEIGHT * value + (1.0 - EMA_WEIGHT) * old


__all__ = ["EMA_WEIGHT", "MAX_PROBE_EVERY", "PROBE_EVERY", "SpecGuard"]
