"""SFT warm start on a tiny Decoder: loss, learning a copy task, no recompilation.

Tolerances: the SFT loss (float32, a token mean over 5 tokens of a log-sum-exp over the
vocabulary) against a float64 recomputation from the same float32 logits: per token
``f32.log_softmax`` (a log and a sum of ``vocab`` exps: ``gamma(V) + 16 U`` relative on
values ~ln V), so ``rtol=1e-5`` for V <= 64.
"""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.train.losses import sequence_batch
from rhyme_jax.train.optim import make_optimizer
from rhyme_jax.train.sft import SFTError, init_opt_state, make_sft_step, run_sft, sft_loss

PAD, EOS = 0, 1


class CharTokenizer:
    """Minimal stand-in with the project tokenizer's API: digits and newline, one id per char."""

    chars = "0123456789\n="
    pad_id, eos_id = PAD, EOS
    vocab_size = 2 + len(chars)

    def encode(self, text):
        return [2 + self.chars.index(c) for c in text]

    def format_prompt(self, template, question):
        return template.format(question=question)


def tiny_model(seed=0, vocab=CharTokenizer.vocab_size):
    cfg = ModelConfig(family="qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    return Decoder(cfg, rngs=nnx.Rngs(seed))


def copy_problems(n, seed=0, length=4):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s = "".join(str(d) for d in rng.integers(0, 10, length))
        out.append(SimpleNamespace(id=i, question=s, solution=s, answer=s))
    return out


def test_sft_loss_matches_brute_force_cross_entropy():
    model = tiny_model()
    b = sequence_batch([[2, 3, 4], [5]], [[6, 7, EOS], [8, EOS]], PAD)
    batch = {k: jnp.asarray(v) for k, v in b.items()}
    loss, m = sft_loss(model, batch)
    logits = np.asarray(model(batch["tokens"], batch["positions"], batch["attn_mask"]), np.float64)
    nll = []
    for row, (plen, resp) in enumerate([(3, [6, 7, EOS]), (1, [8, EOS])]):
        for i, tok in enumerate(resp):
            z = logits[row, plen - 1 + i]  # logits at t predict tokens[t + 1]
            nll.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[tok])
    np.testing.assert_allclose(float(loss), np.mean(nll), rtol=1e-5)
    assert float(m["num_tokens"]) == 5


def test_sft_loss_missing_key():
    with pytest.raises(SFTError, match="loss_mask"):
        sft_loss(tiny_model(), {"tokens": jnp.zeros((1, 16), jnp.int32), "positions": None, "attn_mask": None})


def test_sft_step_no_recompile_and_params_only_trained():
    model = tiny_model()
    graphdef, state = nnx.split(model)
    tx = make_optimizer(1e-2, 10, 0, 0.0, 1.0)
    opt_state = init_opt_state(tx, state)
    step = make_sft_step(graphdef, tx)
    tok = CharTokenizer()
    before = jax.tree.map(np.asarray, state)
    for k in range(3):
        probs = copy_problems(4, seed=k)
        b = sequence_batch([tok.encode(p.question + "=") for p in probs],
                           [tok.encode(p.solution) + [EOS] for p in probs], PAD, max_len=16)
        batch = {key: jnp.asarray(b[key]) for key in ("tokens", "positions", "attn_mask", "loss_mask")}
        state, opt_state, metrics = step(state, opt_state, batch)
        assert float(metrics["skipped"]) == 0.0 and np.isfinite(float(metrics["grad_norm"]))
    assert step._cache_size() == 1  # equal shapes: compiled once
    changed = [not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state))]
    assert all(changed)


def test_sft_step_skips_nonfinite():
    model = tiny_model()
    graphdef, state = nnx.split(model)
    tx = make_optimizer(1e-2, 10, 0, 0.0, 1.0)
    opt_state = init_opt_state(tx, state)
    # poison one weight: loss becomes NaN, so the step must leave everything as it was
    emb = state["embed"]["embedding"]
    emb[...] = emb[...].at[3, 0].set(jnp.nan)
    before = jax.tree.map(np.asarray, state)
    b = sequence_batch([[2, 3]], [[4, EOS]], PAD)
    batch = {k: jnp.asarray(b[k]) for k in ("tokens", "positions", "attn_mask", "loss_mask")}
    state, _, metrics = make_sft_step(graphdef, tx)(state, opt_state, batch)
    assert float(metrics["skipped"]) == 1.0
    for a, c in zip(jax.tree.leaves(before), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, np.asarray(c))


def test_run_sft_learns_copy_task():
    tok = CharTokenizer()
    problems = copy_problems(256)
    model = tiny_model(seed=1)
    cfg = SimpleNamespace(steps=40, batch_size=16, learning_rate=1e-2, warmup_steps=4, weight_decay=0.0)
    log = []
    out = run_sft(model, tok, problems, cfg, prompt_template="{question}=", seed=0, progress=False,
                  log_fn=lambda step, m: log.append((step, m)))
    assert out is model
    assert [s for s, _ in log] == list(range(1, 41))
    first = np.mean([m["loss"] for _, m in log[:3]])
    last = np.mean([m["loss"] for _, m in log[-3:]])
    assert first > 2.0  # ~ln(vocab) at init
    assert last < 0.3 * first, (first, last)
    assert log[-1][1]["token_accuracy"] > 0.9  # it copies, not just the digit unigram
    # the returned model holds the trained weights: held-out copy loss is low too
    held = copy_problems(32, seed=99)
    b = sequence_batch([tok.encode(p.question + "=") for p in held],
                       [tok.encode(p.solution) + [EOS] for p in held], PAD)
    loss, _ = sft_loss(model, {k: jnp.asarray(v) for k, v in b.items()})
    assert float(loss) < 0.3 * first


def test_run_sft_errors():
    cfg = SimpleNamespace(steps=1, batch_size=2, learning_rate=1e-2, warmup_steps=0, weight_decay=0.0)
    with pytest.raises(SFTError, match="no problems"):
        run_sft(tiny_model(), CharTokenizer(), [], cfg, prompt_template="{question}", seed=0, progress=False)
    bad = [SimpleNamespace(question="12", solution="", answer="")]
    with pytest.raises(SFTError, match="empty solution"):
        run_sft(tiny_model(), CharTokenizer(), bad, cfg, prompt_template="{question}", seed=0, progress=False)


def test_run_sft_max_tokens_trains_on_the_problems_that_fit():
    """``sft.max_tokens``: only problems with prompt + solution + eos within it are batched (every
    token counted of a step is of a short problem), and none fitting is an error."""
    tok = CharTokenizer()
    short = [SimpleNamespace(question="12", solution="12", answer="")] * 4
    long = [SimpleNamespace(question="1234567", solution="1234567", answer="")] * 4
    cfg = SimpleNamespace(steps=2, batch_size=4, learning_rate=1e-2, warmup_steps=0, weight_decay=0.0,
                          max_tokens=6)  # "12=" + "12" + eos = 6 tokens; the long ones need 16
    log = []
    run_sft(tiny_model(), tok, short + long, cfg, prompt_template="{question}=", seed=0, progress=False,
            log_fn=lambda step, m: log.append(m))
    assert [m["num_tokens"] for m in log] == [4 * 3.0, 4 * 3.0]  # "12" + eos scored per problem
    with pytest.raises(SFTError, match="sft.max_tokens=3"):
        run_sft(tiny_model(), tok, short, SimpleNamespace(**{**vars(cfg), "max_tokens": 3}),
                prompt_template="{question}=", seed=0, progress=False)


def test_padding_free_sft_packs_rows_and_trains_the_same():
    """``sft.padding_free``: 24 short copy problems and one of 100 tokens, batches of 8 packed
    into fewer buffers of the longest problem's length; 3 steps from the same weights give the
    padded run's losses and token counts and its weights, within float32 rounding of sums over
    other shapes (masked padding, segment-local attention: ``rtol`` 1e-5 on O(1) losses, ``atol``
    1e-5 on weights of O(0.1) after 3 AdamW steps of lr 1e-2)."""
    from rhyme_jax.train.sft import pack_sft_batch

    tok = CharTokenizer()
    problems = copy_problems(24, length=5) + [SimpleNamespace(id=99, question="1" * 50, solution="2" * 48, answer="")]
    enc = [(tok.encode(p.question + "="), tok.encode(p.solution) + [EOS]) for p in problems[:8]]
    padded = sequence_batch([p for p, _ in enc], [r for _, r in enc], PAD, max_len=100)
    packed = pack_sft_batch(padded)
    assert packed["tokens"].shape[0] < 8 and packed["tokens"].shape[1] == padded["tokens"].shape[1]
    assert packed["loss_mask"].sum() == padded["loss_mask"].sum() and packed["segment_ids"].max() > 1
    base = dict(steps=3, batch_size=8, learning_rate=1e-2, warmup_steps=0, weight_decay=0.0, max_tokens=0)
    logs, states = {}, {}
    for free in (False, True):
        logs[free] = []
        model = run_sft(tiny_model(seed=2), tok, problems, SimpleNamespace(**base, padding_free=free),
                        prompt_template="{question}=", seed=3, progress=False,
                        log_fn=lambda step, m, f=free: logs[f].append(m))
        states[free] = nnx.state(model, nnx.Param)
    for a, b in zip(logs[False], logs[True]):
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
        assert a["num_tokens"] == b["num_tokens"] and a["token_accuracy"] == b["token_accuracy"]
    for a, b in zip(jax.tree.leaves(states[False]), jax.tree.leaves(states[True])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)
