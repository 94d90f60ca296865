"""float32 error bounds for the tests' tolerances, derived from the unit roundoff.

A test that compares two float32 results computed by *different* programs (the decode program
against the dense forward, a paged layout against a padded one, JAX against torch) takes its
tolerance from here, from the quantities of that test (reduction lengths, logit magnitudes,
vocabulary size, depth), not from a number tuned on one CPU. Where two results come from the same
program on the same inputs they are bit-identical and the test asserts equality instead.

Standard rounding-error analysis (N. J. Higham, *Accuracy and Stability of Numerical Algorithms*,
2nd ed., SIAM 2002; chapters 2-3): every float32 operation returns ``fl(x op y) = (x op y)(1 + d)``
with ``|d| <= U = 2**-24`` (round to nearest, no underflow). Consequences used here:

* a sum or dot product of length ``k`` in **any** order (XLA's CPU and GPU reductions use
  different orders) has ``|fl(a.b) - a.b| <= gamma(k) * sum_i |a_i b_i|`` (Higham eq. 3.5),
  ``gamma(k) = k U / (1 - k U)``: the *worst case*, which real reductions rarely approach;
* the *probabilistic* bound of N. J. Higham and T. Mary ("A new approach to probabilistic rounding
  error analysis", SIAM J. Sci. Comput. 41(5), 2019, Thm 3.1): if the rounding errors are
  independent with mean zero, ``gamma(k)`` may be replaced by
  ``gamma_prob(k) = exp(LAMBDA sqrt(k) U + k U^2 / (1 - U)) - 1 ~ LAMBDA sqrt(k) U``, which
  fails with probability at most ``k * 2 exp(-LAMBDA^2 (1 - U)^2 / 2)`` (LAMBDA = 7: < 5e-11 per
  term, so under 1e-5 even for a whole SmolLM2 forward). Used only where the worst case is too
  loose to catch a real bug (a 30-layer model), and said so there.

Every bound is a bound on *one* program's error against exact arithmetic; two programs computing
the same quantity therefore differ by at most twice it (``between_programs``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

U = 2.0 ** -24  # float32 unit roundoff (half the gap between 1 and the next float32)
LAMBDA = 7.0  # confidence parameter of the probabilistic bounds (failure probability 2 exp(-24.5))
# Accuracy of XLA's float32 transcendental functions (exp, log, tanh, rsqrt): a few ulps; 4 ulps
# = 8 U covers the CPU (Eigen / XLA polynomial) and GPU (libdevice) implementations.
TRANSCENDENTAL_ULPS = 8.0


def gamma(k: int) -> float:
    """Worst-case relative error factor of a length-``k`` float32 reduction, ``k U / (1 - k U)``.

    Raises ValueError when ``k U >= 1`` (no bound exists)."""
    if k * U >= 1.0:
        raise ValueError(f"gamma({k}) undefined: k * U >= 1")
    return k * U / (1.0 - k * U)


def gamma_prob(k: int, lam: float = LAMBDA) -> float:
    """Probabilistic relative error factor of a length-``k`` reduction (Higham & Mary 2019):
    ``exp(lam sqrt(k) U + k U^2 / (1 - U)) - 1``; assumes independent, mean-zero rounding errors."""
    return math.expm1(lam * math.sqrt(k) * U + k * U * U / (1.0 - U))


def dot(k: int, abs_sum: float) -> float:
    """Absolute error bound of a float32 dot product / sum of length ``k`` in any order:
    ``gamma(k) * abs_sum`` with ``abs_sum = sum_i |a_i b_i|`` (same units as the result)."""
    return gamma(k) * abs_sum


def log_softmax(max_abs_logit: float, vocab: int, logit_err: float = 0.0) -> float:
    """Absolute error bound of one float32 ``log_softmax`` entry (nats) over ``vocab`` logits.

    ``log_softmax(x)_i = (x_i - m) - log(sum_j exp(x_j - m))``, ``m = max x``, ``|x| <= M``:
    ``x_j - m`` has error ``<= 2 M U``, which ``exp`` turns into a relative error of each term, plus
    ``exp``'s own ulps; the positive sum adds ``gamma(vocab)`` relative error; ``log`` turns the
    sum's relative error into an absolute one and adds its ulps on ``log S <= log vocab``; the final
    subtraction adds ``U (2 M + log vocab)``. Errors ``logit_err`` already in the logits add
    ``2 logit_err`` (log_softmax moves by at most ``|dx_i| + max_j |dx_j|``). Assumes no overflow
    (``x - m <= 0``) and that the row's maximum is one of its entries (it is)."""
    sum_rel = 2 * max_abs_logit * U + TRANSCENDENTAL_ULPS * U + gamma(vocab)
    log_err = sum_rel + TRANSCENDENTAL_ULPS * U * math.log(vocab)
    return log_err + U * (2 * max_abs_logit + math.log(vocab)) + 2 * logit_err


def between_programs(bound: float) -> float:
    """Two programs each within ``bound`` of the exact value differ by at most ``2 * bound``."""
    return 2.0 * bound


def decoder_widths(num_layers: int, hidden: int, intermediate: int, num_heads: int,
                   head_dim: int, seq_len: int) -> list[int]:
    """Reduction lengths on a decoder's path from embedding to logits, in order: per layer the
    RMSNorm mean (hidden), the q/k/v projections (hidden), the scores (head_dim), the softmax sum
    and the probabilities times values (seq_len), the output projection (num_heads * head_dim), the
    second RMSNorm, the gate/up projections (hidden) and the down projection (intermediate); then
    the final RMSNorm and the unembedding (hidden)."""
    layer = [hidden, hidden, head_dim, seq_len, seq_len, num_heads * head_dim, hidden, hidden,
             intermediate]
    return layer * num_layers + [hidden, hidden]


def forward(widths: Iterable[int], scale: float, probabilistic: bool = False) -> float:
    """Absolute error bound (units of ``scale``) of a network output of magnitude ``scale``.

    Each reduction of length ``k`` on the path contributes a relative error ``gamma(k)`` (worst
    case) or ``gamma_prob(k)`` (probabilistic); the worst case adds them, the probabilistic bound
    adds them in quadrature (independent errors). Assumes what a pre-norm residual decoder gives:
    each layer's relative error is carried to the output without amplification (RMSNorm divides
    out the scale, the residual stream adds), and cancellation in each dot product is mild
    (``sum |a_i b_i|`` within a small factor of the output scale), so the error is relative to
    the output's magnitude ``scale`` (e.g. the largest |logit|). Plus 8 ulps per layer-level
    transcendental (rsqrt, silu, softmax exp) on the path."""
    widths = list(widths)
    if probabilistic:
        rel = math.sqrt(sum(gamma_prob(k) ** 2 for k in widths))
    else:
        rel = sum(gamma(k) for k in widths)
    return scale * (rel + TRANSCENDENTAL_ULPS * U * len(widths))


def model_logits(cfg, seq_len: int, max_abs_logit: float, probabilistic: bool = False) -> float:
    """``forward`` bound of a ``ModelConfig`` / HF-like config's logits over ``seq_len`` positions
    (absolute, in logit units; ``max_abs_logit`` the largest |logit| of the comparison)."""
    get = (lambda *names: next(getattr(cfg, n) for n in names if hasattr(cfg, n)))
    layers = get("num_layers", "num_hidden_layers")
    hidden = get("hidden_size")
    heads = get("num_heads", "num_attention_heads")
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    widths = decoder_widths(layers, hidden, get("intermediate_size"), heads, head_dim, seq_len)
    return forward(widths, max_abs_logit, probabilistic)


def logprobs(cfg, seq_len: int, max_abs_logit: float, temperature: float = 1.0,
             probabilistic: bool = False) -> float:
    """Largest difference (nats) between two programs' logprobs of the same token under
    ``log_softmax(logits / temperature)`` of a ``cfg`` model over ``seq_len`` positions, e.g. the
    engine's decode / verify program against the trainer's dense forward: each program's logits
    are within ``model_logits`` of exact (divided by ``temperature``, one more rounding), each
    log_softmax within ``log_softmax`` of exact on its own logits. ``max_abs_logit``: the largest
    |logit| (before the temperature) of the rows compared."""
    scaled = max_abs_logit / temperature
    dlogit = between_programs(model_logits(cfg, seq_len, max_abs_logit, probabilistic)) / temperature
    dlogit += 2 * U * scaled
    return between_programs(log_softmax(scaled, cfg.vocab_size)) + 2 * dlogit


def log_softmax_between_programs(logits, temperature: float = 1.0) -> float:
    """Largest difference (nats) between two programs' ``log_softmax(logits / temperature)`` of
    the same float32 ``logits`` array (last axis the vocabulary): ``between_programs`` of
    ``log_softmax`` at its largest |logit| / temperature, the division one more rounding."""
    import numpy as np

    x = np.asarray(logits, np.float64)
    scaled = float(np.abs(x).max()) / (temperature or 1.0)
    return between_programs(log_softmax(scaled, x.shape[-1], logit_err=U * scaled))


def logits_between_programs(cfg, seq_len: int, ref, probabilistic: bool = False) -> float:
    """Largest difference between two programs' float32 logits of a ``cfg`` model (JAX vs torch,
    scanned vs unrolled layers, before vs after an export) over ``seq_len`` positions:
    ``between_programs(model_logits(...))`` at the largest |logit| of ``ref``."""
    import numpy as np

    return between_programs(model_logits(cfg, seq_len, float(np.abs(np.asarray(ref)).max()), probabilistic))


def short(roundings: int, transcendentals: int = 0) -> float:
    """Relative error bound of one float32 result of a short computation against its exact value:
    ``roundings`` basic operations (each <= U relative) and ``transcendentals`` exp / log / rsqrt
    calls (each <= ``TRANSCENDENTAL_ULPS`` U); to first order the bounds add (Higham 2002,
    Lemma 3.3: ``prod (1 + d_i)^{+-1} = 1 + theta_n`` with ``|theta_n| <= gamma(n)``)."""
    return (roundings + TRANSCENDENTAL_ULPS * transcendentals) * U


def cancellation(abs_terms: float, result: float) -> float:
    """Condition number of a sum: ``sum |x_i| / |sum x_i|``; a relative bound of the terms
    becomes this many times larger on the result (Higham 2002, eq. 4.3)."""
    return abs_terms / max(abs(result), 1e-300)
