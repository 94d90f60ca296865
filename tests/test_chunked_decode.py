"""Several decode passes per dispatch (``rollout/chunk.py``, ``rollout.passes_per_dispatch``): the
chunked engine emits the per-pass engine's tokens, masks rows that finish mid-chunk, compiles only
enumerated programs, and its config key is checked."""

import jax
import numpy as np
import pytest

from rhyme_jax.compile_count import CompileCounter
from rhyme_jax.config import RolloutSection
from rhyme_jax.config.checks import ConfigError
from rhyme_jax.rollout import chunk
from rhyme_jax.rollout.engine import EngineConfigError, SamplingParams
from rhyme_jax.rollout.shapes import plan
from test_rollout_engine import MAX_NEW, PAGE, _dense_greedy, _engine, _model, _prompts, logprob_atol


_SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)


def _sampled_eos(slots):
    """A token the per-pass engine's sampled rollout of ``_prompts(0)`` emits mid-sequence in
    some rows but not all (so rows stop at different passes, inside chunks)."""
    res = _engine(max_slots=slots, max_prefill_tokens=32).generate(_model()[1], _prompts(0), _SAMPLED,
                                                                    jax.random.key(3))
    counts = {}
    for t in res.tokens:
        for tok in set(t[1:-2].tolist()):
            counts[tok] = counts.get(tok, 0) + 1
    return min(counts, key=lambda t: (abs(counts[t] - len(res.tokens) // 2), t))


@pytest.mark.parametrize("slots", [1, pytest.param(3, marks=pytest.mark.slow)])  # 3: 2 more programs, 15 s
def test_chunks_emit_the_per_pass_tokens_and_logprobs(slots):
    """Sampled (T = 1) with a stop token that ends rows mid-chunk and fewer slots than the 6
    requests (admission at chunk ends): chunks of 5 passes give the per-pass engine's tokens; the
    behaviour logprobs agree within the float32 bound of two programs (``logprob_atol``: a chunk
    keeps its row bucket where the per-pass engine shrinks it). Fewer dispatches than passes."""
    state, prompts, eos = _model()[1], _prompts(0), _sampled_eos(slots)
    runs = {n: _engine(max_slots=slots, eos_ids=(eos,), max_prefill_tokens=32, passes_per_dispatch=n).generate(
        state, prompts, _SAMPLED, jax.random.key(3)) for n in (1, 5)}
    assert {"eos", "length"} <= set(runs[1].finish_reasons)
    atol = logprob_atol(prompts, runs[1].tokens)
    for n in (5,):
        for got, want, glp, wlp in zip(runs[n].tokens, runs[1].tokens, runs[n].logprobs, runs[1].logprobs):
            np.testing.assert_array_equal(got, want)
            np.testing.assert_allclose(glp, wlp, atol=atol, rtol=0)
        s = runs[n].stats
        assert runs[n].finish_reasons == runs[1].finish_reasons
        assert s["generated_tokens"] == runs[1].stats["generated_tokens"]
        assert s["decode_dispatches"] < s["decode_steps"] and runs[1].stats["decode_dispatches"] == runs[1].stats[
            "decode_steps"]
    for r in runs.values():  # the prefill passes' share of the blocked time (fewer slots: several prefills)
        assert r.stats["prefill_steps"] > 1 and 0 < r.stats["prefill_wait_seconds"] < r.stats["device_wait_seconds"]


@pytest.mark.slow  # 15 s on 2 shared cores (compiles the dense reference and the chunk programs)
def test_chunks_with_a_short_pool_keep_greedy_outputs():
    """12 pages (3 sequences of 7 pages need 21): chunks that the pool cannot hold fall back to
    per-pass steps, which preempt; the outputs are still dense greedy decoding's."""
    state, prompts = _model()[1], _prompts(0)
    res = _engine(num_pages=12, passes_per_dispatch=4).generate(
        state, prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW), jax.random.key(0))
    assert res.stats["preemptions"] > 0 and res.stats["decode_dispatches"] < res.stats["decode_steps"]
    want, _ = _dense_greedy(prompts, MAX_NEW)
    for got, exp in zip(res.tokens, want):
        np.testing.assert_array_equal(got, exp)


def test_rows_done_mid_chunk_stop_writing():
    """Two rows with 2 tokens in their pages; row 0 may emit 1 token, row 1 three: the chunk
    runs 3 passes, row 0 emits once and writes only its position 2; row 1 writes positions 2-4.
    Every other slot of their pages stays zero (the pool starts at zero)."""
    eng = _engine(max_slots=2, passes_per_dispatch=4)
    state = _model()[1]
    runner = eng.runner(state, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    eng.allocator.ensure(0, 2 * PAGE)
    eng.allocator.ensure(1, 2 * PAGE)
    pages = eng.allocator.page_table[:2, :2].copy()
    inp = chunk.ChunkInputs(np.array([5, 6], np.int32), np.array([2, 2], np.int32), pages,
                            np.array([0, 1], np.int32), np.array([1, 3], np.int32), chunk.eos_array(()), 2, 4, 4,
                            np.arange(2))
    toks, _, count, n_run = runner.run(inp)
    assert count.tolist() == [1, 3] and int(n_run) == 3
    k = np.asarray(eng.kv.k)  # [L, KVH, P, page_size, hd]
    for row, written in ((0, {2}), (1, {2, 3, 4})):
        for pos in range(2 * PAGE):
            nonzero = bool(np.any(k[:, :, pages[row, pos // PAGE], pos % PAGE]))
            assert nonzero == (pos in written), (row, pos)


@pytest.mark.slow  # 15 s on 2 shared cores (compiles every program of the plan)
def test_warmup_covers_the_chunk_programs():
    """``passes_per_dispatch > 1`` adds one chunk program per row bucket and width; warm-up runs
    them and a greedy rollout then compiles nothing, runs only enumerated programs, and matches
    dense greedy."""
    eng = _engine(max_slots=2, max_prefill_tokens=16, passes_per_dispatch=3)
    state = _model()[1]
    sp = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
    progs = eng.programs(spec=False)
    chunks = [p for p in progs if p.kind == "chunk"]
    assert len(chunks) == len(eng.plan.widths) * 2 and eng.warmup(state, sp) == len(progs)  # buckets 1, 2
    prompts = _prompts(6, (16, 1, 2, 9))
    with CompileCounter() as counter:
        res = eng.generate(state, prompts, sp, jax.random.key(0))
    assert counter.count == 0 and eng.programs_run <= set(progs) and any(p.kind == "chunk" for p in eng.programs_run)
    for got, exp in zip(res.tokens, _dense_greedy(prompts, MAX_NEW)[0]):
        np.testing.assert_array_equal(got, exp)


def test_passes_per_dispatch_is_checked_and_planned():
    with pytest.raises(ConfigError, match="rollout.passes_per_dispatch"):
        RolloutSection(passes_per_dispatch=0)
    with pytest.raises(EngineConfigError, match="passes_per_dispatch"):
        _engine(passes_per_dispatch=0)
    base = dict(max_slots=64, page_size=16, max_prompt_len=96, max_new_tokens=64)
    assert not [p for p in plan(**base).programs() if p.kind == "chunk"]
    chunked = plan(**base, passes_per_dispatch=8)
    assert chunked.passes == 8
    assert len([p for p in chunked.programs() if p.kind == "chunk"]) == 3 * len(chunked.widths)
