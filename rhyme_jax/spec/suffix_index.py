"""Per-prompt HistoSpec index: suffix automaton over the prompt and its previous responses.

RhymeRL (arXiv 2508.18588) s.4 HistoSpec. For one prompt the index covers

* the plain ``prompt`` string, and
* for each kept response j, ``prompt[-5:] + response_j + [SEP]`` (SEP = -1, never a vocabulary id;
  the prompt tail lets the first response tokens be drafted from the end of the prompt).

The plain prompt string ends in END (-2). SEP and END are "continuations" like any token: they
count in the branch probabilities and, when chosen, stop the walk; they are never drafted.

Scoring (per automaton state, i.e. per distinct context string x):

* ``count(x)``: occurrences of x in all indexed strings (prompt occurrences included);
* reward mean of x: ``sum of r_j over the occurrences of x inside response string j`` divided by
  the number of those occurrences (occurrence-weighted; occurrences in the ``prompt[-5:]`` head of
  string j belong to response j). Occurrences in the plain prompt string count for ``count`` but
  are excluded from the reward mean; a child with no response occurrence ranks below every child
  with one.

Draft rule (``draft``): pattern = the last ``pattern_max`` tokens of the running sequence; the
longest suffix of it that occurs is used (backing off down to ``pattern_min``; shorter -> empty
draft). From there the continuation is walked one token at a time: among the children x+c choose
by ``branch="reward"`` (highest reward mean, then count, then smaller token id; paper) or
``"count"`` (highest count, then smaller token id; specRL code). The running branch probability is
the product of ``count(child) / count(parent)`` (every occurrence has exactly one continuation, so
this is the child's share); stop before a token that makes it fall below ``min_token_prob``
(0 disables), at SEP/END, or at ``max_len`` tokens.

Build: O(total length) (numba suffix automaton, ``sam_kernels.py``); lookup O(pattern length).
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Float, Int

from rhyme_jax.config.sections import SpecSection
from rhyme_jax.spec import sam_kernels as K

SEP = -1  # ends each response string
END = -2  # ends the plain prompt string
PROMPT_HEAD = 5  # prompt tokens prepended to each response string
BRANCHES = {"reward": K.BRANCH_REWARD, "count": K.BRANCH_COUNT}
_FIELDS = K.SamArrays._fields  # length, link, cnt, rcnt, rsum, cptr, ctok, cto, htab


def _tokens(name: str, a) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"{name}: expected a 1-D integer token array, got {a.dtype}{a.shape}")
    if a.size and (a.min() < 0 or a.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{name}: token ids must lie in [0, 2**31) (negative ids are separators)")
    return a.astype(np.int32)


_EMPTY: list = []


def _empty_index() -> "SuffixIndex":
    if not _EMPTY:
        _EMPTY.append(SuffixIndex.build(np.zeros(0, np.int32), [], np.zeros(0)))
    return _EMPTY[0]


def check_draft_args(branch: str, min_token_prob: float, pattern_max: int, pattern_min: int) -> int:
    """Validate the draft-rule settings; returns the numba branch code.

    Raises:
      ValueError: unknown ``branch``, ``min_token_prob`` outside [0, 1], or not
        ``1 <= pattern_min <= pattern_max``.
    """
    if branch not in BRANCHES:
        raise ValueError(f"branch: expected one of {sorted(BRANCHES)}, got {branch!r}")
    if not 0.0 <= float(min_token_prob) <= 1.0:
        raise ValueError(f"min_token_prob: expected a value in [0, 1], got {min_token_prob}")
    if not 1 <= int(pattern_min) <= int(pattern_max):
        raise ValueError(f"pattern_min/pattern_max: need 1 <= pattern_min <= pattern_max, got "
                         f"{pattern_min}/{pattern_max}")
    return BRANCHES[branch]


class IndexPack:
    """Several indexes handed to one batched numba call without copying them: ``lists`` is a
    ``sam_kernels.SamArrays`` of numba typed lists, one per field, item i = ``indexes[i]``'s
    array. O(number of indexes)."""

    def __init__(self, indexes: list["SuffixIndex"]):
        from numba.typed import List

        if not indexes:  # typed lists need an item to know their type; slots are all -1 then
            indexes = [_empty_index()]
        self.size = len(indexes)
        self.lists = K.SamArrays(*(List([getattr(ix, f) for ix in indexes]) for f in _FIELDS))

    @classmethod
    def of(cls, indexes: list["SuffixIndex"]) -> "IndexPack":
        """The pack of ``indexes`` (slot i = ``indexes[i]``)."""
        return cls(list(indexes))


class SuffixIndex:
    """Suffix automaton of one prompt's history with count and reward statistics (module doc).

    Attributes (numpy arrays, S states, E edges; not to be modified): ``length, link, cnt, rcnt,
    rsum, cptr, ctok, cto, htab`` as documented in ``sam_kernels``.
    """

    def __init__(self, arrays: tuple[np.ndarray, ...]):
        for f, a in zip(_FIELDS, arrays):
            setattr(self, f, a)
        self._pack: IndexPack | None = None
        self._derived: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # best_children / compact, per branch

    def best_children(self, branch: str) -> tuple[Int[np.ndarray, "S"], Int[np.ndarray, "S"]]:
        """Each state's best non-terminator child by ``branch`` (``"reward"`` | ``"count"``):
        ``(child int32[S] (-1: none), token int32[S])`` (``sam_kernels.best_children``); computed
        once per branch rule (a concurrent first call may compute it twice, harmlessly).

        Raises:
          ValueError: unknown branch.
        """
        if branch not in BRANCHES:
            raise ValueError(f"branch: expected one of {sorted(BRANCHES)}, got {branch!r}")
        got = self._derived.get(branch)
        if got is None:
            got = K.best_children(self.cnt, self.rcnt, self.rsum, self.cptr, self.ctok, self.cto, BRANCHES[branch])
            self._derived[branch] = got
        return got

    def compact(self, branch: str) -> tuple[Int[np.ndarray, "S 5"], Int[np.ndarray, "H 2"]]:
        """The index as goodput drafting reads it (``candidates.compact``): ``states int32[S, 5]``
        (length, link, count, best child by ``branch``, its token) and the transition hash
        ``trans int64[H, 2]``; computed once per branch rule.

        Raises:
          ValueError: unknown branch.
        """
        key = "compact-" + branch
        got = self._derived.get(key)
        if got is None:
            from rhyme_jax.spec.candidates import compact

            child, token = self.best_children(branch)
            got = compact(self.length, self.link, self.cnt, self.cptr, self.ctok, self.cto, child, token)
            self._derived[key] = got
        return got

    @property
    def pack(self) -> IndexPack:
        """A pack holding only this index (made once)."""
        if self._pack is None:
            self._pack = IndexPack([self])
        return self._pack

    @property
    def nbytes(self) -> int:
        """Host memory of the index arrays in bytes."""
        return sum(getattr(self, f).nbytes for f in _FIELDS)

    @property
    def num_states(self) -> int:
        """Number of automaton states (<= 2 x text length)."""
        return int(self.length.size)

    @classmethod
    def build(
        cls,
        prompt: Int[np.ndarray, "Lp"],
        responses: list[Int[np.ndarray, "L"]],
        rewards: Float[np.ndarray, "M"],
    ) -> "SuffixIndex":
        """Index ``prompt`` and ``prompt[-5:] + response_j + [SEP]`` for every response.

        Args:
          prompt: ``int[Lp]`` prompt token ids (>= 0; may be empty).
          responses: M token arrays (ids >= 0; may be empty).
          rewards: ``float[M]`` finite reward of each response.

        Raises:
          ValueError: a token array is not 1-D integer or holds a negative id, or ``rewards`` does
            not have M finite values (the message names the argument).
        """
        prompt = _tokens("prompt", prompt)
        resp = [_tokens(f"responses[{j}]", r) for j, r in enumerate(responses)]
        rw = np.asarray(rewards, dtype=np.float64)
        if rw.shape != (len(resp),) or not np.all(np.isfinite(rw)):
            raise ValueError(f"rewards: expected {len(resp)} finite values, got shape {rw.shape}")
        head = prompt[-PROMPT_HEAD:] if prompt.size else prompt
        parts = [prompt, np.array([END], np.int32)]
        sizes = [prompt.size + 1]
        for r in resp:
            parts += [head, r, np.array([SEP], np.int32)]
            sizes.append(head.size + r.size + 1)
        text = np.concatenate(parts).astype(np.int32)
        sizes = np.asarray(sizes)
        pos_reward = np.repeat(np.concatenate([[0.0], rw]), sizes)
        pos_resp = np.repeat(np.r_[0, np.ones(len(resp))].astype(np.int8), sizes)
        return cls(K.build_sam(text, pos_reward, pos_resp))

    def count(self, pattern: Int[np.ndarray, "m"]) -> int:
        """Occurrences of ``pattern`` (ids >= 0, m >= 1) in the indexed strings (0 if absent)."""
        v = 0
        for c in _tokens("pattern", pattern).tolist():
            v = K.lookup(self.cptr, self.ctok, self.cto, self.htab, v, c)
            if v < 0:
                return 0
        return int(self.cnt[v]) if v else 0

    def draft(
        self,
        context_tail: Int[np.ndarray, "P"],
        max_len: int,
        *,
        branch: str,
        min_token_prob: float,
        pattern_max: int = SpecSection.pattern_max,
        pattern_min: int = SpecSection.pattern_min,
    ) -> Int[np.ndarray, "n"]:
        """Draft continuation of one running sequence (rule in the module docstring).

        Args:
          context_tail: ``int[P]`` last tokens of prompt + generated so far (negative entries are
            padding: only the tokens after the last negative one are used).
          max_len: most tokens to draft (>= 0).
          branch: ``"reward"`` | ``"count"``.
          min_token_prob: branch-probability floor in [0, 1] (0 disables).
          pattern_max / pattern_min: longest / shortest context suffix matched.

        Returns:
          ``int32[n]``, n <= max_len, no separators.

        Raises:
          ValueError: bad settings (named).
        """
        tails = np.asarray(context_tail).reshape(1, -1).astype(np.int32)
        max_len = int(max_len)
        if max_len < 0:
            raise ValueError(f"max_len: expected >= 0, got {max_len}")
        drafts, lens = draft_batch(self.pack, np.zeros(1, np.int64), tails, np.array([max_len]),
                                   branch=branch, min_token_prob=min_token_prob,
                                   pattern_max=pattern_max, pattern_min=pattern_min)
        return drafts[0, : lens[0]].copy()


def draft_batch(
    pack: IndexPack,
    slots: Int[np.ndarray, "B"],
    tails: Int[np.ndarray, "B P"],
    max_lens: Int[np.ndarray, "B"],
    *,
    branch: str,
    min_token_prob: float,
    pattern_max: int = SpecSection.pattern_max,
    pattern_min: int = SpecSection.pattern_min,
) -> tuple[Int[np.ndarray, "B W"], Int[np.ndarray, "B"]]:
    """Batched drafting: row b drafts from index ``slots[b]`` of ``pack`` (-1: no index).

    Args:
      pack: the indexes (``IndexPack.of``).
      slots: ``int[B]`` pack slot of each row, -1 for none (empty draft).
      tails: ``int[B, P]`` last tokens of each running sequence, left-padded with negatives.
      max_lens: ``int[B]`` most tokens per row (<= 0: none).

    Returns:
      ``(drafts int32[B, W], lens int32[B])`` with W = max(max_lens, 0); padding 0. Row b equals
      ``SuffixIndex.draft`` of its index.

    Raises:
      ValueError: bad settings or shapes (named).
    """
    code = check_draft_args(branch, min_token_prob, pattern_max, pattern_min)
    tails = np.ascontiguousarray(tails, dtype=np.int32)
    b = tails.shape[0] if tails.ndim == 2 else -1
    slots = np.asarray(slots, dtype=np.int64)
    max_lens = np.asarray(max_lens, dtype=np.int64)
    if tails.ndim != 2:
        raise ValueError(f"tails: expected a 2-D [B, P] array, got shape {tails.shape}")
    if slots.shape != (b,) or max_lens.shape != (b,):
        raise ValueError(f"slots/max_lens: expected shape ({b},), got {slots.shape}/{max_lens.shape}")
    if b and slots.max(initial=-1) >= pack.size:
        raise ValueError(f"slots: index {slots.max()} out of range for a pack of {pack.size}")
    width = int(max(max_lens.max(initial=0), 0))
    out = np.zeros((b, width), np.int32)
    lens = np.zeros(b, np.int32)
    rule = K.DraftRule(code, float(min_token_prob), int(pattern_max), int(pattern_min))
    K.draft_batch(pack.lists, slots, tails, max_lens, rule, out, lens)
    return out, lens
