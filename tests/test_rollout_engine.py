"""Rollout engine: paged greedy == dense greedy, no recompilation, preemption, sampling."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rhyme_jax.compile_count import CompileCounter
from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.rollout import batching, sampling
from rhyme_jax.rollout.engine import (EngineConfig, EngineConfigError, PromptTooLongError, RolloutEngine,
                                      SamplingParams)
from rhyme_jax.rollout.page_allocator import PageAllocationError, PageAllocator
from rhyme_jax.train import grpo_step, losses

import f32

CFG = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
MAX_PROMPT, MAX_NEW, PAGE = 16, 12, 4
PROMPT_LENS = (3, 7, 11, 5, 9, 14)


@functools.lru_cache(maxsize=None)
def _model():
    # Larger init scale than the default 0.02 so greedy outputs vary across positions/prompts.
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: x * 20.0 if x.ndim == 2 else x, state)
    return graphdef, state


def _prompts(seed, lens=PROMPT_LENS):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, CFG.vocab_size, size=n).tolist() for n in lens]


@functools.lru_cache(maxsize=None)
def _dense_fn():
    graphdef, _ = _model()

    @jax.jit
    def full_logits(state, tokens, lens):
        model = nnx.merge(graphdef, state)
        t = tokens.shape[1]
        pos = jnp.broadcast_to(jnp.arange(t), tokens.shape)
        return model(tokens, pos, pos < lens[:, None])

    return full_logits


def _dense_greedy(prompts, max_new, eos=()):
    """Greedy decode re-running the dense model on the whole sequence at every step."""
    _, state = _model()
    fn = _dense_fn()
    width = MAX_PROMPT + MAX_NEW
    outs, lps = [], []
    for p in prompts:
        seq, lp = list(p), []
        for _ in range(max_new):
            toks = np.zeros((1, width), np.int32)
            toks[0, : len(seq)] = seq
            logits = np.asarray(fn(state, toks, np.array([len(seq)])))[0, len(seq) - 1]
            t = int(np.argmax(logits))
            lp.append(float(jax.nn.log_softmax(logits)[t]))
            seq.append(t)
            if t in eos:
                break
        outs.append(np.array(seq[len(p):], np.int32))
        lps.append(np.array(lp, np.float32))
    return outs, lps


def _engine(**kw):
    graphdef, _ = _model()
    args = dict(max_slots=3, page_size=PAGE, num_pages=0, max_prompt_len=MAX_PROMPT,
                max_new_tokens=MAX_NEW, eos_ids=())
    args.update(kw)
    eng = RolloutEngine(graphdef, CFG, EngineConfig(**args))
    eng.check_invariants = True  # allocator.check() (no page owned twice) after every step
    return eng


@functools.lru_cache(maxsize=None)
def _reference_with_eos():
    prompts = _prompts(0)
    outs, _ = _dense_greedy(prompts, MAX_NEW)
    # EOS = a token greedy emits mid-sequence for some prompts, so they stop early at different times.
    counts = {}
    for o in outs:
        for t in set(o[2:-1].tolist()):
            counts[t] = counts.get(t, 0) + 1
    eos = min(counts, key=lambda t: (abs(counts[t] - len(outs) // 2), t))
    outs, lps = _dense_greedy(prompts, MAX_NEW, eos=(eos,))
    return prompts, eos, outs, lps


def logprob_atol(prompts, responses, temperature=1.0):
    """float32 bound (nats) on the difference between two programs' logprobs (decode, verify,
    dense forward) of ``responses`` after ``prompts`` under ``softmax(logits / temperature)``:
    ``f32.logprobs`` of CFG with attention over at most MAX_PROMPT + MAX_NEW keys, at the largest
    |logit| of these sequences (~1e-3 nats here; a wrong token's logprob is O(0.1) away)."""
    batch = losses.sequence_batch(prompts, [np.asarray(r).tolist() for r in responses], 0)
    logits = np.asarray(_dense_fn()(_model()[1], batch["tokens"], batch["lengths"]))
    valid = np.arange(logits.shape[1])[None, :] < batch["lengths"][:, None]
    return f32.logprobs(CFG, MAX_PROMPT + MAX_NEW, float(np.abs(logits[valid]).max()), temperature)


@functools.lru_cache(maxsize=None)
def greedy_logprob_atol():
    """``logprob_atol`` of the greedy reference sequences (``_reference_with_eos``)."""
    prompts, _, outs, _ = _reference_with_eos()
    return logprob_atol(prompts, outs)


def test_paged_greedy_matches_dense():
    prompts, eos, want, want_lp = _reference_with_eos()
    lens = [len(o) for o in want]
    assert len(set(lens)) > 1 and min(lens) < MAX_NEW  # finishing at different times
    eng = _engine(eos_ids=[eos])
    res = eng.generate(_model()[1], prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW),
                       jax.random.key(0))
    for got, exp, glp, elp in zip(res.tokens, want, res.logprobs, want_lp):
        np.testing.assert_array_equal(got, exp)
        np.testing.assert_allclose(glp, elp, atol=greedy_logprob_atol(), rtol=0)
    assert res.finish_reasons == ["eos" if o[-1] == eos else "length" for o in want]
    assert res.stats["generated_tokens"] == sum(lens)
    assert res.stats["prefill_tokens"] == sum(PROMPT_LENS)
    assert res.stats["preemptions"] == 0
    # one forward pass per generated token of the longest chain at least; slots are refilled
    assert res.stats["decode_steps"] + res.stats["prefill_steps"] == res.stats["forward_passes"]


def test_preemption_keeps_greedy_outputs():
    prompts, eos, want, _ = _reference_with_eos()
    # pages_per_seq = ceil(28 / 4) = 7: 8 usable pages cannot hold 3 growing sequences.
    eng = _engine(eos_ids=[eos], num_pages=9)
    ensure, calls = eng.allocator.ensure, []

    def checked_ensure(slot, n):  # after every allocation: no page owned by two slots, no leak
        ensure(slot, n)
        eng.allocator.check()
        calls.append(slot)

    eng.allocator.ensure = checked_ensure
    res = eng.generate(_model()[1], prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW),
                       jax.random.key(0))
    assert res.stats["preemptions"] > 0
    for got, exp in zip(res.tokens, want):
        np.testing.assert_array_equal(got, exp)
    eng.allocator.check()
    assert eng.allocator.num_free == 8 and len(calls) > len(prompts)  # everything returned


@pytest.mark.parametrize("num_pages", [0, 12])
def test_shared_prompt_prefix_keeps_greedy_outputs(num_pages):
    """Samples of one prompt share its full pages (fewer prefill tokens) and still decode exactly
    like dense greedy; with a small pool, preemption releases shared pages correctly."""
    base = _prompts(7, (13, 9, 4))
    prompts = [p for p in base for _ in range(3)]  # groups of 3 samples
    want, _ = _dense_greedy(base, MAX_NEW)
    eng = _engine(max_slots=5, num_pages=num_pages)
    sp = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
    res = eng.generate(_model()[1], prompts, sp, jax.random.key(0))
    for i, got in enumerate(res.tokens):
        np.testing.assert_array_equal(got, want[i // 3])
    if num_pages:
        assert res.stats["preemptions"] > 0  # re-prefills add tokens here
    else:
        assert res.stats["prefill_tokens"] < sum(len(p) for p in prompts)
    eng.allocator.check()
    assert eng.allocator.num_free == eng.num_pages - 1
    off = _engine(max_slots=5, share_prompt_prefix=False).generate(_model()[1], prompts, sp, jax.random.key(0))
    assert off.stats["prefill_tokens"] == sum(len(p) for p in prompts)


def test_prefill_cuts_sequences_into_attention_rows():
    """A prefill row of ``n`` new tokens after ``start`` cached ones becomes ``ceil(n / Q)``
    attention rows ending at each chunk's last token; logits rows are each sequence's last token."""
    table = np.arange(2 * 7, dtype=np.int32).reshape(2, 7)
    a, b = np.arange(1, 21, dtype=np.int32), np.array([5, 6, 7], np.int32)
    inp = batching.prefill_inputs([(0, a, 0), (1, b, 8)], table, PAGE, 2, 64, 6, 8)
    m = inp.meta
    np.testing.assert_array_equal(m.cu_q_lens, [0, 8, 16, 20, 23, 23, 23])
    np.testing.assert_array_equal(m.kv_lens, [8, 16, 20, 11, 0, 0])
    np.testing.assert_array_equal(m.page_indices[:4], table[[0, 0, 0, 1]])
    assert int(m.num_seqs[0]) == 4 and inp.max_q_len == 8
    np.testing.assert_array_equal(inp.logits_rows, [19, 22])
    np.testing.assert_array_equal(inp.positions[20:23], [8, 9, 10])
    np.testing.assert_array_equal(m.slot_mapping[20:23], [table[1, 2] * PAGE, table[1, 2] * PAGE + 1,
                                                          table[1, 2] * PAGE + 2])
    with pytest.raises(ValueError, match="does not fit"):  # 3 + 1 chunks > 3 rows
        batching.prefill_inputs([(0, a, 0), (1, b, 8)], table, PAGE, 2, 64, 3, 8)


def test_chunked_prefill_keeps_greedy_outputs(monkeypatch):
    """With 8 slots and chunks of at least 4 tokens, a 64-token prefill cuts sequences into
    chunks of 8: prompts of 11 and 14 tokens and the re-prefills of preempted sequences span
    several attention rows and still decode exactly like dense greedy."""
    from rhyme_jax.rollout import shapes

    monkeypatch.setattr(shapes, "MIN_PREFILL_Q", 4)
    prompts, eos, want, _ = _reference_with_eos()
    eng = _engine(eos_ids=[eos], max_slots=8, num_pages=12, max_prefill_tokens=32)
    assert eng.plan.prefill_layout(64) == (8 + 64 // 8, 8)
    longest = []
    orig = batching.prefill_inputs

    def spy(batch, *args, **kw):
        longest.append(max(len(b[1]) for b in batch))
        return orig(batch, *args, **kw)

    monkeypatch.setattr(batching, "prefill_inputs", spy)
    res = eng.generate(_model()[1], prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW),
                       jax.random.key(0))
    assert res.stats["preemptions"] > 0 and max(longest) > 8  # some sequence spanned two chunks
    for got, exp in zip(res.tokens, want):
        np.testing.assert_array_equal(got, exp)
    eng.allocator.check()


def test_prefill_runs_at_the_batch_page_table_width(monkeypatch):
    """A prefill reads only the page-table columns its batch holds (``ShapePlan.width`` of the
    batch's pages): with widths (2, 7) and one slot, prompts of at most 8 tokens prefill at 2
    columns, longer ones at 7, and greedy outputs still equal dense greedy."""
    from rhyme_jax.rollout import shapes

    monkeypatch.setattr(shapes, "MIN_DECODE_WIDTH", 2)
    prompts, eos, want, _ = _reference_with_eos()
    eng = _engine(eos_ids=[eos], max_slots=1)
    assert eng.plan.widths == (2, 7)
    res = eng.generate(_model()[1], prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW),
                       jax.random.key(0))
    for got, exp in zip(res.tokens, want):
        np.testing.assert_array_equal(got, exp)
    assert {s.width for s in eng.programs_run if s.kind == "prefill"} == {2, 7}
    assert eng.programs_run <= set(eng.programs(spec=False))
    table = np.arange(2 * 7, dtype=np.int32).reshape(2, 7)
    a = np.arange(1, 9, dtype=np.int32)  # 8 tokens: 2 pages of 4
    inp = batching.prefill_inputs([(0, a, 0)], table, PAGE, 2, 64, 6, 8, width=2)
    np.testing.assert_array_equal(inp.meta.page_indices[0], table[0, :2])
    assert inp.meta.page_indices.shape == (6, 2)
    with pytest.raises(ValueError, match="past a page-table width of 2 pages"):
        batching.prefill_inputs([(1, a[:3], 6)], table, PAGE, 2, 64, 6, 8, width=2)


def test_allocator_shares_and_frees_by_reference_count():
    a = PageAllocator(num_pages=8, page_size=4, max_slots=3, pages_per_seq=4)
    a.ensure(0, 10)  # 3 pages
    a.share(1, 0, 2)
    a.ensure(1, 13)  # 2 shared + 2 own
    a.check()
    assert a.num_free == 7 - 5
    with pytest.raises(PageAllocationError, match="must be empty"):
        a.share(1, 0, 1)
    a.free(0)  # shared pages stay with slot 1
    a.check()
    assert a.num_free == 7 - 4 and list(a.page_table[1, :2]) != [0, 0]
    a.free(1)
    a.check()
    assert a.num_free == 7


def test_pool_too_small_for_one_sequence():
    with pytest.raises(EngineConfigError, match="cannot hold one full-length sequence"):
        _engine(num_pages=7)


def test_engine_config_checks_its_fields_and_is_built_from_the_run_config():
    import dataclasses
    from pathlib import Path

    from rhyme_jax.config import load_config

    base = dict(max_slots=3, page_size=PAGE, max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW)
    for field, bad, msg in (("max_slots", 0, "max_slots must be >= 1, got 0"),
                            ("max_new_tokens", -1, "max_new_tokens must be >= 1, got -1"),
                            ("num_pages", -2, "num_pages must be >= 0, got -2"),
                            ("on_overlong_prompt", "drop", "on_overlong_prompt must be 'error' or 'skip'")):
        with pytest.raises(EngineConfigError, match=msg):
            EngineConfig(**{**base, field: bad})
    with pytest.raises(EngineConfigError, match=r"eos_ids \[64\] outside \[0, vocab_size=64\)"):
        _engine(eos_ids=[64])  # checked against the model by the engine
    c = EngineConfig(**base, eos_ids=[np.int64(5), 7])
    assert c.eos_ids == (5, 7) and c.max_seq_len == MAX_PROMPT + MAX_NEW and c.attention_impl == "reference"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_slots = 4
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny_test.yaml", ["rollout.max_slots=6", "rollout.max_verify_tokens=40",
                                                 "rollout.on_overlong_prompt=skip"])
    run = EngineConfig.from_run(cfg, (1, 2))
    r = cfg.rollout
    assert run == EngineConfig(max_slots=6, page_size=r.page_size, max_prompt_len=r.max_prompt_len,
                               max_new_tokens=r.max_new_tokens, eos_ids=(1, 2), num_pages=r.num_pages,
                               on_overlong_prompt="skip", attention_impl=r.attention_impl, max_verify_tokens=40,
                               share_prompt_prefix=r.share_prompt_prefix)
    eng = RolloutEngine(_model()[0], CFG, dataclasses.replace(run, attention_impl="reference"))
    assert (eng.max_slots, eng.eos_ids, eng.verify_budget, eng.on_overlong_prompt) == (6, (1, 2), 40, "skip")
    assert eng.config.max_verify_tokens == 40


def _count_compiles(fn):
    events, active = [], [True]

    def listener(name, secs, **kw):
        if active[0] and "backend_compile" in name:
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out = fn()
    finally:
        active[0] = False  # jax.monitoring has no public unregister
    return len(events), out


def test_no_recompilation_on_second_generate():
    eng = _engine(max_prefill_tokens=32)  # one prefill bucket (64 tokens); decode width 7
    assert eng.prefill_buckets == (64,) and eng.decode_widths == (7,)
    assert eng.plan.prefill_layout(64) == (3 + 64 // 32, 32)  # 3 slots: chunks of pow2(64 / 3)
    state = _model()[1]
    sp = SamplingParams(temperature=0.7, top_k=12, top_p=0.85, max_new_tokens=8)  # shares programs
    eng.generate(state, _prompts(1, (5, 9, 4, 12, 6)), sp, jax.random.key(1))
    # different prompts, same buckets (prefill packs 5+9+4 / 12+6 then 8+3+10 / 9+9: all in 64)
    n, res = _count_compiles(lambda: eng.generate(state, _prompts(2, (8, 3, 10, 9, 9)), sp,
                                                  jax.random.key(2)))
    assert n == 0
    assert sum(len(t) for t in res.tokens) == res.stats["generated_tokens"] > 0


def test_warmup_compiles_every_bucket():
    """Warm-up compiles each step shape once, also with ``compile_threads`` > 1 (every shape
    compiled ahead of time on a thread pool; the dummy steps that follow reuse those programs:
    the same number of XLA compilations as one thread), then generate compiles nothing and still
    matches dense greedy decoding."""
    state = _model()[1]
    sp = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
    compiles = {}
    for threads in (1, 3):
        jax.clear_caches()  # both start cold
        eng = _engine(max_slots=2, max_prefill_tokens=16)
        with CompileCounter() as counter:
            n_shapes = eng.warmup(state, sp, compile_threads=threads)
        compiles[threads] = counter.count
    n_rows = len(batching.seq_buckets(eng.max_slots))
    n_prefill = len(eng.prefill_buckets)
    assert n_shapes == n_prefill + n_rows * len(eng.decode_widths) == len(eng.programs(spec=False))
    assert compiles[3] == compiles[1] > n_shapes  # the shapes + the KV pool (+ key setup)
    prompts = _prompts(6, (16, 1, 2, 9))
    n, res = _count_compiles(lambda: eng.generate(state, prompts, sp, jax.random.key(0)))
    assert n == 0
    want, _ = _dense_greedy(prompts, MAX_NEW)  # warm-up writes touched only scratch page 0
    for got, exp in zip(res.tokens, want):
        np.testing.assert_array_equal(got, exp)


def test_pass_pairs():
    """A decode/verify step packs the first ``(T, Q)`` pair of its row bucket holding its tokens;
    plain decode is ``(S, 1)``; three packed sizes from 1.5 S to the cap (every row's 33 tokens
    limited by the budget), geometrically; ``Q <= min(33, T - S + 1, 2 T / S + 1)``."""
    from rhyme_jax.rollout import shapes
    assert shapes.verify_pairs(128, 512) == ((128, 1), (192, 4), (320, 6), (512, 9))
    assert shapes.verify_pairs(32, 512) == ((32, 1), (48, 4), (160, 11), (512, 33))
    assert shapes.verify_pairs(128, 4224) == ((128, 1), (192, 4), (904, 15), (4224, 33))
    assert shapes.verify_pairs(1, 64) == ((1, 1), (2, 2), (8, 8), (33, 33))
    assert shapes.verify_pairs(128, 512, spec=False) == ((128, 1),)
    plan = shapes.plan(max_slots=32, page_size=16, max_prompt_len=64, max_new_tokens=64)
    assert [plan.pass_pair(32, u) for u in (20, 32, 33, 64, 65, 128)] == \
        [(32, 1), (32, 1), (48, 4), (80, 6), (80, 6), (128, 9)]
    with pytest.raises(ValueError, match="more than the cap 128"):
        plan.pass_pair(32, 129)


def test_sampled_logprobs_are_behaviour_logprobs_and_reproducible():
    eng = _engine()
    state = _model()[1]
    prompts = _prompts(3, (4, 10, 6))
    sp = SamplingParams(temperature=0.7, top_k=12, top_p=0.85, max_new_tokens=8)
    res = eng.generate(state, prompts, sp, jax.random.key(5))
    again = eng.generate(state, prompts, sp, jax.random.key(5))
    for a, b in zip(res.tokens, again.tokens):
        np.testing.assert_array_equal(a, b)
    assert_behaviour_logprobs(prompts, res, 0.7, 12, 0.85)


def assert_behaviour_logprobs(prompts, res, temperature, top_k, top_p):
    """Each emitted token's reported logprob equals the trainer's logprob of it at the same
    temperature (``grpo_step.make_logprob_fn``: the dense model on prompt + response, scored under
    the unfiltered ``softmax(logits / temperature)``), so the first update's ratios are 1 whatever
    top-k / top-p filtered the draws; and every token lies in the filtered support.

    The engine's decode / verify programs and the trainer's forward are different XLA programs
    (paged KV cache, other reduction orders), so the two logprobs agree to the float32 bound
    ``logprob_atol`` (~2e-3 nats here, worst case; a wrong position or token moves a logprob by
    O(0.1) or more and still fails). Returns the worst difference seen."""
    graphdef, state = _model()
    batch = losses.sequence_batch(prompts, [t.tolist() for t in res.tokens], 0)
    scored = np.asarray(grpo_step.make_logprob_fn(graphdef, temperature)(state, batch))
    logits = np.asarray(_dense_fn()(state, batch["tokens"], batch["lengths"]))
    rows = [logits[b, len(p) - 1: len(p) - 1 + len(t)] for b, (p, t) in enumerate(zip(prompts, res.tokens))]
    atol = logprob_atol(prompts, res.tokens, temperature)
    worst = 0.0
    for b, (p, toks, lps) in enumerate(zip(prompts, res.tokens, res.logprobs)):
        want = scored[b, len(p) - 1: len(p) - 1 + len(toks)]
        np.testing.assert_allclose(lps, want, rtol=0, atol=atol)
        # the first update's ratio: |exp(d) - 1| <= expm1(atol) for |d| <= atol
        np.testing.assert_allclose(np.exp(lps - want), 1.0, rtol=0, atol=np.expm1(atol) * (1 + 1e-6))
        worst = max(worst, float(np.max(np.abs(lps - want), initial=0.0)))
        support = np.asarray(sampling.processed_logprobs(jnp.asarray(rows[b]), temperature, top_k, top_p))
        assert np.all(np.isfinite(support[np.arange(len(toks)), toks]))  # drawn from the filtered law
    return worst


def test_overlong_prompt_error_and_skip():
    prompts = _prompts(4, (5, MAX_PROMPT + 1, 6))
    sp = SamplingParams(temperature=0.0, max_new_tokens=3)
    with pytest.raises(PromptTooLongError, match=r"prompt 1 has 17 tokens.*max_prompt_len=16"):
        _engine().generate(_model()[1], prompts, sp, jax.random.key(0))
    res = _engine(on_overlong_prompt="skip").generate(_model()[1], prompts, sp, jax.random.key(0))
    assert res.finish_reasons == ["length", "skipped", "length"]
    assert res.stats["skipped"] == 1 and len(res.tokens[1]) == 0 and len(res.logprobs[1]) == 0
    want, _ = _dense_greedy([prompts[0], prompts[2]], 3)
    np.testing.assert_array_equal(res.tokens[0], want[0])
    np.testing.assert_array_equal(res.tokens[2], want[1])
    with pytest.raises(EngineConfigError, match="prompt 0 is empty"):
        _engine().generate(_model()[1], [[]], sp, jax.random.key(0))


def test_page_allocator_free_list():
    a = PageAllocator(num_pages=6, page_size=4, max_slots=3, pages_per_seq=3)
    assert a.num_free == 5 and a.can_alloc(5) and not a.can_alloc(6)
    assert [a.pages_for(n) for n in (0, 1, 4, 5, 12)] == [0, 1, 1, 2, 3]
    np.testing.assert_array_equal(a.pages_for(np.array([0, 1, 4, 5, 12])), [0, 1, 1, 2, 3])
    a.ensure(0, 5)  # 2 pages
    a.ensure(1, 12)  # 3 pages
    assert a.num_free == 0 and list(a.num_held) == [2, 3, 0]
    held = set(a.page_table[0, :2]) | set(a.page_table[1, :3])
    assert held == {1, 2, 3, 4, 5}  # scratch page 0 never handed out, no page twice
    with pytest.raises(PageAllocationError, match="only 0 free"):
        a.ensure(2, 1)
    with pytest.raises(PageAllocationError, match="page table row holds 3"):
        a.ensure(0, 13)
    assert a.free(1) == 3 and a.num_free == 3 and list(a.page_table[1]) == [0, 0, 0]
    a.ensure(2, 9)
    a.check()
    assert not set(a.page_table[2]) & set(a.page_table[0, :2])


# ---------------------------------------------------------------- sampling


def _np_processed(logits, temperature, top_k, top_p):
    x = logits.astype(np.float64) / temperature
    out = np.full_like(x, -np.inf)
    for r in range(x.shape[0]):
        order = np.argsort(-x[r], kind="stable")
        keep = order[:top_k] if top_k > 0 else order
        p = np.exp(x[r, keep] - x[r, keep].max())
        p /= p.sum()
        cum = np.cumsum(p)
        n = int(np.searchsorted(cum, top_p - 1e-12)) + 1 if top_p < 1 else len(keep)
        kept = keep[:n]
        z = x[r, kept] - x[r, kept].max()
        out[r, kept] = z - np.log(np.exp(z).sum())
    return out


@pytest.mark.parametrize("t,k,p", [(1.0, 5, 1.0), (0.7, 0, 0.8), (1.3, 10, 0.5), (1.0, 0, 1.0), (0.5, 3, 0.3)])
def test_processed_logprobs_match_numpy(t, k, p):
    logits = np.random.default_rng(7).standard_normal((6, 40)).astype(np.float32) * 3
    got = np.asarray(sampling.processed_logprobs(jnp.asarray(logits), t, k, p))
    want = _np_processed(logits, t, k, p)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    # float32 against float64 (~exact): one program's log_softmax bound over the 40 logits / t
    scaled = float(np.abs(logits).max()) / t
    one = f32.log_softmax(scaled, logits.shape[1], logit_err=f32.U * scaled)
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], atol=one, rtol=0)
    # the dynamic program (traced parameters) selects the same distribution: a different program
    dyn = np.asarray(sampling.processed_logprobs(jnp.asarray(logits), jnp.float32(t), jnp.int32(k),
                                                 jnp.float32(p)))
    np.testing.assert_array_equal(np.isinf(dyn), np.isinf(got))
    np.testing.assert_allclose(dyn[np.isfinite(dyn)], got[np.isfinite(got)], atol=f32.between_programs(one), rtol=0)


def test_greedy_sampling():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((4, 30)), jnp.float32)
    tok, lp = sampling.sample(logits, jax.random.key(0), 0.0, 5, 0.5)
    np.testing.assert_array_equal(tok, np.argmax(logits, -1))
    # sample's log_softmax and jax.nn.log_softmax: two programs over the same 30 logits
    atol = f32.between_programs(f32.log_softmax(float(jnp.abs(logits).max()), logits.shape[1]))
    np.testing.assert_allclose(lp, jax.nn.log_softmax(logits)[np.arange(4), tok], atol=atol, rtol=0)
    tok2, _ = sampling.sample(logits, jax.random.key(0), jnp.float32(0.0), jnp.int32(5), jnp.float32(0.5))
    np.testing.assert_array_equal(tok2, tok)
    with pytest.raises(sampling.SamplingError, match="top_p"):
        sampling.sample(logits, jax.random.key(0), 1.0, 0, 0.0)


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.8, 6, 0.9)])
def test_sample_frequencies_chi_square(t, k, p):
    row = np.random.default_rng(3).standard_normal(12).astype(np.float32) * 0.5
    n = 20000
    logits = jnp.asarray(np.tile(row, (n, 1)))
    tok, lp = jax.jit(lambda l, key: sampling.sample(l, key, t, k, p))(logits, jax.random.key(11))
    probs = np.exp(np.asarray(sampling.processed_logprobs(logits[:1], t, k, p))[0])
    tok = np.asarray(tok)
    assert np.all(probs[tok] > 0)  # never samples a filtered token
    # behaviour logprob: under softmax(logits / t) without the filter (what the loss scores)
    scored = np.asarray(jax.nn.log_softmax(logits[0] / t))
    scaled = float(np.abs(row).max()) / t  # two programs' log_softmax of the 12 logits / t
    atol = f32.between_programs(f32.log_softmax(scaled, len(row), logit_err=f32.U * scaled))
    np.testing.assert_allclose(np.asarray(lp), scored[tok], atol=atol, rtol=0)
    support = probs > 0
    counts = np.bincount(tok, minlength=len(row))[support]
    expected = probs[support] * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square 0.999 quantile (z = 3.09).
    crit = df * (1 - 2 / (9 * df) + 3.09 * np.sqrt(2 / (9 * df))) ** 3
    assert chi2 < crit, (chi2, crit)
    assert support.sum() < len(row) or k == 0  # filtering really removed tokens


def test_decode_programs_update_the_kv_pool_in_place():
    """No decode/verify program copies the donated KV pool: XLA's compiled temporaries of every
    step shape (``compiled.memory_analysis()``) stay far below one pool. Regression: the 1-token
    decode program's write (a scatter XLA turns into a dynamic-update-slice) was fused into two
    consumers of different pool shapes, and XLA copied the whole pool six times per layer (the
    1-row decode of SmolLM2 ran 5 s a pass on CPU against 0.08 s for a 1-row verify pass)."""
    _, state = _model()
    eng = _engine(max_slots=2, num_pages=4096)  # a 2 MiB pool: larger than any temporary
    sp = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
    runner = eng.runner(state, sp)
    pool_bytes = eng.kv.k.nbytes
    seen = set()
    for shape in eng.programs(spec=True):
        if shape.kind == "prefill":
            continue
        temp = runner.lower(runner.inputs(shape)).compile().memory_analysis().temp_size_in_bytes
        assert temp < pool_bytes // 4, (shape, temp, pool_bytes)
        seen.add(shape.tokens)
    assert 1 in seen and max(seen) > 1  # the 1-token decode program and verify programs


def test_bf16_programs_never_widen_or_copy_the_kv_pool():
    """bfloat16 rollouts on CPU (``live_pages`` attention, the CPU default): the pool is stored as
    its uint16 bits and no decode or verify program holds it in float32 or bfloat16, or needs a
    pool's worth of temporaries. XLA's CPU backend converted the whole pool to float32 around the
    KV write and the page gather (a SmolLM2 decode pass at 3.5x the float32 one) until both read
    it as uint16; a bfloat16 pool bitcast to uint16 inside the pass was then still copied twice a
    layer (``kv_cache.storage_dtype``)."""
    _, state = _model()
    eng = _engine(max_slots=2, num_pages=4096, dtype="bfloat16", attention_impl="live_pages")
    runner = eng.runner(state, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW))
    dims = ",".join(str(d) for d in eng.kv.k.shape)
    assert eng.kv.dtype == jnp.bfloat16 and eng.kv.k.dtype == jnp.uint16
    kinds = set()
    for shape in eng.programs(spec=True):
        if shape.kind != "prefill":
            compiled = runner.lower(runner.inputs(shape)).compile()
            text = compiled.as_text()
            assert f"f32[{dims}]" not in text and f"bf16[{dims}]" not in text, shape
            assert compiled.memory_analysis().temp_size_in_bytes < eng.kv.k.nbytes, shape
            kinds.add(shape.kind)
    assert kinds == {"decode", "verify"}
