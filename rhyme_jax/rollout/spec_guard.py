"""Realized-throughput guard of HistoSpec chunks: run a plain chunk where verify chunks have
emitted fewer tokens per second than decode would.

The chunked engine (``rollout/chunk_spec.py``) sizes a HistoSpec chunk from the host drafter's
estimates, but the device drafts by its own single longest match, and on the ledger task's L5 run
(docs/results.md, "L5 at commit fab1bef") those chunks accepted 0.36 draft tokens a row-pass
where a 64-row verify pass cost 1.6-2.6x a decode pass at the same page-table width: epoch 2 ran
0.82x plain. A chunk of ``r`` live rows that accepts ``g`` draft tokens per row-pass emits
``r (1 + g)`` tokens per verify pass against ``r`` per decode pass, so it pays iff
``(1 + g) * decode_seconds > verify_seconds``. The guard keeps ``g`` and both seconds per pass as
realized (exponential averages: HistoSpec chunks of one row bucket, page-table width and verify
program for ``g`` and their seconds a pass, plain chunks of the row bucket and width for
decode's) and declines a chunk that would not pay. Keying by the verify program lets the chunked
engine grow a chunk's draft room where its rows accept whole drafts (a response stuck repeating
one token, which runs to the token cap and sets the step's makespan) without the larger program's
cost judging the smaller rungs. Probes back off: the ``PROBE_EVERY``-th declined chunk of a key runs, and each
probe that again does not pay doubles the interval (at most ``MAX_PROBE_EVERY``); one that pays
resets it. The pass-cost model alone was not enough: a verify program of one ``(T, Q)`` pair
has few live times in a rollout, and its profiled cost under the row bucket's live scale priced
verify chunks at about 1.5 decode passes where they ran at 2.7 (the ledger run at 6c5fe19: the
guard declined 4 of the chunks of a step whose HistoSpec rollout ran 0.71x plain). At d10609c,
with realized seconds but a fixed probe every 8th chunk, the probes were most of the HistoSpec
chunks that ran (186 declined, 29 run in one step) at 5x a plain pass each (device drafting over
long histories included): epoch 2 0.86x. Probing lets a key whose acceptance rises (prompts that
gained history) be measured again. A first try or a probe (a trial, ``SpecGuard.trial``) runs at
most ``TRIAL_PASSES`` passes of the chunk: on the ledger run at 48869c4 the trials that did not
pay were what the steps without a row at the token cap lost (0.84-0.94x plain in 5 of the 12
such steps: 2-9 trial chunks of 16 passes at about 2x a decode pass each). A few passes measure a
key's acceptance and seconds, if more noisily than sixteen (docs/results.md, "L5 at commit 195d6c0").
A rung's drafts also promise the next: where the rate at which they were accepted would make the
next rung's longer drafts pay (the expected accepted tokens of a draft whose tokens each land with
that rate, Leviathan et al. 2023, eq. 1), the next rung is tried even if this one does not pay,
also the rung just above the chunk's ask, and a rung judged on older chunks is tried again once
the rate below it has risen by ``PROMISE_MARGIN``. On the ledger run the rows at the token cap
settle into repeating one line: a small rung accepts all of its 1-token drafts while its own
tokens a second stay below decode's, and the climb had waited for the probes' back-off (the
always-right oracle's step 2 of the bound unit: 711-843 passes before, 272-405 with the promise;
docs/results.md, "L5 at commit b0bed53"). Plain and HistoSpec chunks sample the same tokens (the
rollout's per-position streams), so the guard changes time, never tokens.

Declined chunks still measure the drafts. Because a draft token is accepted exactly when it is the
token plain sampling draws there, the tokens a plain chunk emits grade the drafts the device would
have made at its start (``chunk_spec``: one ``lookup_drafts`` over the chunk's history and the
rows' own tokens, compared with what the rows then emitted): ``observe_shadow`` keeps that
per-token acceptance rate per row bucket and width, and where it has risen (by ``PROMISE_MARGIN``
since it last had a rung tried) so far that a rung's drafts would pay, that rung gets a trial at
once instead of waiting for the probe's back-off. On the ledger run's bound unit at 0b760a5 (idle
2-core CPU) the back-off had grown to hundreds of chunks while the rows at the token cap decoded
their first ~1,500 tokens (about 0.5 accepted per pass), and their period, which an ideal
self-lookup drafter accepts 32 tokens a pass from about 2,000 tokens on (a replay over the saved
tokens), was never probed again: step 2 ran 3,917 of plain's 4,096 passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY = 8  # declined chunks of a key before its first probing HistoSpec chunk
MAX_PROBE_EVERY = 256  # the longest interval between probes after repeated failures
EMA_WEIGHT = 0.5  # weight of the newest chunk in the realized acceptance per row-pass
TRIAL_PASSES = 4  # most passes of a trial chunk (a key's first try or a probe)
PROMISE_MARGIN = 0.1  # rise in the rung below's acceptance rate that has a rung tried again


@dataclass
class SpecGuard:
    """Realized acceptance of HistoSpec chunks per ``(rows, width, tokens)``, and the decision it gives.

    A key is a row bucket, a page-table width and a verify program's packed tokens ``T`` (one
    rung of ``shapes.verify_pairs``): each rung is judged apart, and of the rungs that paid the
    one that emitted the most tokens a second runs (``choose``). Plain decode's seconds are kept
    per ``(rows, width)``.

    Attributes:
      gain: ``(rows, width, tokens) -> accepted draft tokens per live row-pass`` (exponential average).
      rate: ``(rows, width, tokens) -> accepted over drafted tokens`` (exponential average).
      promised: ``(rows, width, tokens) -> the rate below`` when a promise last had it tried.
      spec_seconds: ``(rows, width, tokens) -> seconds per pass`` of HistoSpec chunks;
        plain_seconds: ``(rows, width) -> seconds per pass`` of plain chunks (exponential
        averages; ``observe_seconds``).
      declined: ``(rows, width, tokens) -> chunks declined since the key last ran``.
      interval: ``(rows, width, tokens) -> declined chunks between probes`` (``PROBE_EVERY``, doubling).
      shadow: ``(rows, width) -> per-token acceptance rate`` of the drafts graded on plain
        chunks' tokens (exponential average; ``observe_shadow``).
      shadow_promised: ``(rows, width, tokens) -> the shadow rate`` at which that rung last got
        a shadow trial (dropped once the rate falls ``PROMISE_MARGIN`` below it).
      enabled: False runs every chunk the host's choice asks for (ablations).
      trial: whether the last ``choose`` picked a key's first try or a probe (the chunk then
        runs at most ``TRIAL_PASSES`` passes, ``chunk_spec.decode``).
    """

    gain: dict[tuple[int, int, int], float] = field(default_factory=dict)
    rate: dict[tuple[int, int, int], float] = field(default_factory=dict)
    promised: dict[tuple[int, int, int], float] = field(default_factory=dict)
    spec_seconds: dict[tuple[int, int, int], float] = field(default_factory=dict)
    plain_seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    declined: dict[tuple[int, int, int], int] = field(default_factory=dict)
    interval: dict[tuple[int, int, int], int] = field(default_factory=dict)
    shadow: dict[tuple[int, int], float] = field(default_factory=dict)
    shadow_promised: dict[tuple[int, int, int], float] = field(default_factory=dict)
    enabled: bool = True
    trial: bool = False

    def choose(self, rows: int, width: int, rungs: list[tuple], decode_seconds: float,
               above: tuple | None = None) -> int | None:
        """The packed tokens ``T`` of the verify program a HistoSpec chunk of ``rows`` row bucket
        at ``width`` pages runs, or None for a plain chunk.

        ``rungs``: the candidate programs ``(tokens, verify_seconds[, room])``, ascending, up
        to the largest the chunk asks for (``verify_seconds``: the engine's ``PassCost`` price,
        used where the key has no realized seconds yet; ``decode_seconds`` likewise for decode;
        ``room``: draft tokens a live row gets there, for the promise); ``above``: the rung
        above the ask, climbed to only on a promise. The guard climbs them from the bottom: an
        unseen rung runs (its first try) once every rung below it paid or promised it (a promise
        renewed by ``PROMISE_MARGIN`` tries a seen rung again); a rung that paid,
        ``(1 + gain) * decode >= verify`` with realized figures, is a candidate; the first rung
        that neither paid nor promised the next stops the climb and is probed after
        ``PROBE_EVERY`` declined chunks (then twice as late each time, at most
        ``MAX_PROBE_EVERY``; a chunk that pays resets it), unless the shadow rate promises it or
        a rung above it first (``_shadow_trial``). Otherwise the candidate that emitted
        the most tokens a second, ``(1 + gain) / verify``, runs. A disabled guard runs the
        largest rung. Sets ``trial`` (a first try, a probe, a renewed or a shadow promise).
        """
        self.trial = False
        if not self.enabled:
            return int(rungs[-1][0]) if rungs else None
        best, best_rate, stop = None, 0.0, None
        decode_key = (int(rows), int(width))
        decode = self.plain_seconds.get(decode_key, float(decode_seconds))
        ladder = [*rungs, above] if above is not None else list(rungs)
        via = None  # the rung below, whose drafts promise this one pays
        for i, (tokens, verify_seconds, *_) in enumerate(ladder):
            key = (int(rows), int(width), int(tokens))
            if key not in self.gain or self._fresh(via, key):
                if via is not None:
                    self.promised[key] = self.rate[via]
                self.trial = True
                return int(tokens)  # first try (the rungs below paid or promise) or a renewed promise
            verify = self.spec_seconds.get(key, float(verify_seconds))
            pays = (1.0 + self.gain[key]) * decode >= verify
            nxt = ladder[i + 1] if i + 1 < len(ladder) else None
            via = key if nxt is not None and self._promising(key, nxt, rows, width, decode) else None
            if not pays and via is None:
                stop = key
                shadow = self._shadow_trial(rows, width, ladder[i:], decode)
                if shadow is not None:
                    self.trial = True
                    return shadow
                break
            if pays and (1.0 + self.gain[key]) / verify > best_rate:
                best, best_rate = key, (1.0 + self.gain[key]) / verify
            if pays and i + 1 == len(rungs) and via is None:
                break  # the chunk's top rung paid: the one above it is climbed only on promise
        if stop is not None:
            self.declined[stop] = self.declined.get(stop, 0) + 1
            every = self.interval.get(stop, PROBE_EVERY)
            if self.declined[stop] >= every:  # a probe; the next one comes twice as late unless this pays
                self.declined[stop] = 0
                self.interval[stop] = min(2 * every, MAX_PROBE_EVERY)
                self.trial = True
                return stop[2]
        if best is None:
            return None
        self.declined[best] = 0
        self.interval.pop(best, None)
        return best[2]

    def _fresh(self, via: tuple[int, int, int] | None, key: tuple[int, int, int]) -> bool:
        """Whether the drafts of ``via`` (the rung below) have been accepted at a rate at least
        ``PROMISE_MARGIN`` above the rate at which they last promised ``key``: ``key``, judged on
        older chunks, is tried again (on the ledger run a response's tail settles into a period
        of one or a few lines: the larger rungs tried before it had settled accepted little)."""
        return via is not None and self.rate[via] >= self.promised.get(key, -1.0) + PROMISE_MARGIN

    def _shadow_trial(self, rows: int, width: int, ladder: list[tuple], decode: float) -> int | None:
        """The packed tokens of the first rung of ``ladder`` (the rung the climb stopped at, then
        those above it) whose drafts would pay at the shadow rate of ``(rows, width)`` and that
        has not had a shadow trial since the rate last rose ``PROMISE_MARGIN``; None if none."""
        a = self.shadow.get((int(rows), int(width)))
        if a is None:
            return None
        for rung in ladder:
            key = (int(rows), int(width), int(rung[0]))
            if a >= self.shadow_promised.get(key, -1.0) + PROMISE_MARGIN and self._pays_at(a, rung, rows, width, decode):
                self.shadow_promised[key] = a
                return key[2]
        return None

    def _promising(self, key: tuple[int, int, int], above: tuple, rows: int, width: int, decode: float) -> bool:
        """Whether the rung ``above`` would pay if its drafts were accepted at the rate ``key``'s
        were (``_pays_at``)."""
        a = self.rate.get(key)
        return a is not None and self._pays_at(a, above, rows, width, decode)

    def _pays_at(self, a: float, above: tuple, rows: int, width: int, decode: float) -> bool:
        """Whether the rung ``above`` (``(tokens, verify_seconds, room)``: ``room`` draft tokens a
        live row gets there) would pay if each draft token were accepted with probability ``a``:
        a row then accepts ``a (1 - a^room) / (1 - a)`` tokens a pass in expectation (Leviathan
        et al. 2023, arXiv 2211.17192, eq. 1), against decode's seconds and ``above``'s
        realized (else priced) ones."""
        if len(above) < 3 or above[2] < 1:
            return False
        room = int(above[2])
        expect = float(room) if a >= 1.0 else a * (1.0 - a ** room) / (1.0 - a)
        verify = self.spec_seconds.get((int(rows), int(width), int(above[0])), float(above[1]))
        return (1.0 + expect) * decode >= verify

    def observe(self, rows: int, width: int, tokens: int, accepted: int, row_passes: int,
                drafted: int = 0) -> None:
        """A HistoSpec chunk of ``rows`` at ``width`` running the ``tokens`` program accepted
        ``accepted`` of ``drafted`` draft tokens over ``row_passes`` live row-passes (no-op when
        it ran none; the acceptance rate only where it drafted)."""
        key = (int(rows), int(width), int(tokens))
        if row_passes > 0:
            _average(self.gain, key, float(accepted) / float(row_passes))
        if drafted > 0:
            _average(self.rate, key, float(accepted) / float(drafted))

    def observe_shadow(self, rows: int, width: int, accepted: int, failed: int) -> None:
        """A plain chunk of ``rows`` at ``width`` against the drafts the device would have made at
        its start: ``accepted`` draft tokens equal to the tokens the rows then emitted, ``failed``
        drafts cut by a token that differed. The per-token rate ``accepted / (accepted +
        failed)`` (each draft token is a trial until the first miss; drafts that ended without
        one are censored) enters ``shadow``; a rung's shadow record is dropped once the rate falls
        ``PROMISE_MARGIN`` below it, so a later rise tries it again. No-op without a graded token."""
        if accepted + failed <= 0:
            return
        cell = (int(rows), int(width))
        _average(self.shadow, cell, float(accepted) / float(accepted + failed))
        a = self.shadow[cell]
        for key in [k for k, v in self.shadow_promised.items() if k[:2] == cell and a < v - PROMISE_MARGIN]:
            del self.shadow_promised[key]

    def observe_seconds(self, spec: bool, rows: int, width: int, tokens: int, seconds_per_pass: float) -> None:
        """A chunk's seconds per pass (its call's seconds over the passes it ran), HistoSpec
        (``spec``, under ``(rows, width, tokens)``) or plain (under ``(rows, width)``)."""
        if spec:
            _average(self.spec_seconds, (int(rows), int(width), int(tokens)), float(seconds_per_pass))
        else:
            _average(self.plain_seconds, (int(rows), int(width)), float(seconds_per_pass))


def _average(table: dict, key: tuple, value: float) -> None:
    old = table.get(key)
    table[key] = value if old is None else EMA_WEIGHT * value + (1.0 - EMA_WEIGHT) * old


__all__ = ["EMA_WEIGHT", "MAX_PROBE_EVERY", "PROBE_EVERY", "PROMISE_MARGIN", "SpecGuard", "TRIAL_PASSES"]
