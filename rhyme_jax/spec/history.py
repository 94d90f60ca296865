"""HistoSpec history store: each prompt's last rollouts, the raw material of its draft index.

RhymeRL (arXiv 2508.18588, s.4 "HistoSpec"): drafts for a prompt come from
the responses of its previous rollout(s). The store keeps, per prompt id, the prompt tokens and the
responses (all n samples), rewards and lengths of the last ``depth`` rollouts, oldest first.

Entries are immutable (read-only arrays in frozen dataclasses) and ``update`` swaps whole entries
in under a lock, so index builds in a background thread can read an entry while the trainer
updates the store.

On disk (``save``/``load``, or ``to_bytes``/``from_bytes`` for checkpoint blobs): one ``.npz`` in CSR layout (like ``io/rollout_log.py``):

* ``prompt_ids int64[P]``, ``prompt_offsets int64[P+1]`` into ``prompt_tokens int32``;
* ``rollout_offsets int64[P+1]`` into the per-rollout arrays ``rollout_steps int64[R]`` and
  ``sample_offsets int64[R+1]``, which delimit each rollout's samples in ``rewards float32[S]``,
  ``lengths int32[S]`` and ``token_offsets int64[S+1]`` (into ``tokens int32``);
* scalars ``depth`` and ``version`` (int64).
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jaxtyping import Float, Int

from rhyme_jax.io.atomic import atomic_write


class HistoryError(ValueError):
    """Bad input to the history store, or a missing/corrupt/inconsistent history file (the message
    names the argument, or the path and the field)."""


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@dataclass(frozen=True)
class Rollout:
    """One rollout of one prompt: its n samples in generation order.

    Attributes:
      step: GRPO step at which the rollout happened.
      responses: n read-only ``int32[L_i]`` token arrays.
      rewards: read-only ``float32[n]``.
      lengths: read-only ``int32[n]`` response lengths in tokens.
    """

    step: int
    responses: tuple[np.ndarray, ...]
    rewards: np.ndarray
    lengths: np.ndarray


@dataclass(frozen=True)
class HistoryEntry:
    """History of one prompt: ``prompt`` (read-only ``int32[Lp]``) and up to ``depth`` rollouts,
    oldest first."""

    prompt: np.ndarray
    rollouts: tuple[Rollout, ...]


def _make_rollout(step: int, responses: list[np.ndarray], rewards: np.ndarray) -> Rollout:
    resp = tuple(_frozen(np.array(r, dtype=np.int32)) for r in responses)
    lengths = np.array([r.size for r in resp], dtype=np.int32)
    return Rollout(int(step), resp, _frozen(np.array(rewards, dtype=np.float32)), _frozen(lengths))


def _check_tokens(name: str, a) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise HistoryError(f"{name}: expected a 1-D integer token array, got {a.dtype}{a.shape}")
    if a.size and (a.min() < 0 or a.max() > np.iinfo(np.int32).max):
        raise HistoryError(f"{name}: token ids must lie in [0, 2**31), got range [{a.min()}, {a.max()}]")
    return a


class HistoryStore:
    """Per-prompt history of the last ``depth`` rollouts.

    Attributes:
      depth: rollouts kept per prompt (>= 1; paper: 1).
      version: bumped by every ``update`` (lets index caches tell what is stale).
    """

    def __init__(self, depth: int = 1):
        """Raises HistoryError when ``depth`` < 1."""
        if int(depth) != depth or depth < 1:
            raise HistoryError(f"depth: expected an integer >= 1, got {depth!r}")
        self.depth = int(depth)
        self.version = 0
        self._entries: dict[int, HistoryEntry] = {}
        self._lock = threading.Lock()  # guards _entries/version (held briefly)
        self._update_lock = threading.Lock()  # serialises updates

    def update(
        self,
        step: int,
        prompt_ids: Int[np.ndarray, "N"],
        prompts: list[np.ndarray],
        responses: list[np.ndarray],
        rewards: Float[np.ndarray, "N"],
    ) -> list[int]:
        """Record the N samples of one GRPO step.

        Samples are grouped by prompt id; each prompt id gets one new rollout holding its samples in
        the order given, and its oldest rollout beyond ``depth`` is dropped. Atomic: all new entries
        are built first and then swapped in, so an exception leaves the store exactly as before.

        Args:
          step: GRPO step (>= 0).
          prompt_ids: ``int[N]`` prompt id of each sample.
          prompts: N prompt token arrays (``int[Lp]``, ids >= 0); samples of one prompt id must
            carry the same prompt.
          responses: N response token arrays (``int[L_i]``, ids >= 0; may be empty).
          rewards: ``float[N]``, finite.

        Returns:
          The updated prompt ids, in order of first appearance.

        Raises:
          HistoryError: an argument has the wrong length, shape, dtype or values (named).
        """
        if int(step) != step or step < 0:
            raise HistoryError(f"step: expected an integer >= 0, got {step!r}")
        ids = np.asarray(prompt_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise HistoryError(f"prompt_ids: expected a 1-D integer array, got {ids.dtype}{ids.shape}")
        n = ids.shape[0]
        rw = np.asarray(rewards, dtype=np.float64)
        for name, val in (("prompts", prompts), ("responses", responses)):
            if len(val) != n:
                raise HistoryError(f"{name}: expected {n} arrays (one per prompt id), got {len(val)}")
        if rw.shape != (n,) or not np.all(np.isfinite(rw)):
            raise HistoryError(f"rewards: expected {n} finite values, got shape {rw.shape}")
        groups: dict[int, list[int]] = {}
        for i, pid in enumerate(ids.tolist()):
            groups.setdefault(int(pid), []).append(i)
        with self._update_lock:
            return self._update(step, groups, prompts, responses, rw)

    def _update(self, step, groups, prompts, responses, rw) -> list[int]:
        with self._lock:
            old = dict(self._entries)
        new: dict[int, HistoryEntry] = {}
        for pid, rows in groups.items():
            prompt = _check_tokens(f"prompts[{rows[0]}]", prompts[rows[0]])
            for i in rows[1:]:
                other = _check_tokens(f"prompts[{i}]", prompts[i])
                if not np.array_equal(other, prompt):
                    raise HistoryError(f"prompts[{i}]: differs from prompts[{rows[0]}] of the same "
                                       f"prompt id {pid}")
            resp = [_check_tokens(f"responses[{i}]", responses[i]) for i in rows]
            rollout = _make_rollout(step, resp, rw[rows])
            kept = old[pid].rollouts[-(self.depth - 1):] if pid in old and self.depth > 1 else ()
            new[pid] = HistoryEntry(_frozen(np.array(prompt, dtype=np.int32)), tuple(kept) + (rollout,))
        with self._lock:
            self._entries.update(new)
            self.version += 1
        return list(new)

    def entry(self, prompt_id: int) -> HistoryEntry | None:
        """The prompt's history (rollouts oldest first), or None if it has none."""
        with self._lock:
            return self._entries.get(int(prompt_id))

    def responses(self, prompt_id: int) -> tuple[list[np.ndarray], Float[np.ndarray, "M"]]:
        """All kept responses of the prompt, oldest rollout first, and their ``float32[M]`` rewards.

        Raises:
          KeyError: the prompt has no history.
        """
        e = self.entry(prompt_id)
        if e is None:
            raise KeyError(f"prompt_id {prompt_id}: no history")
        resp = [r for ro in e.rollouts for r in ro.responses]
        return resp, np.concatenate([ro.rewards for ro in e.rollouts]).astype(np.float32)

    def lengths(self, prompt_id: int) -> Int[np.ndarray, "n"] | None:
        """``int32[n]`` response lengths of the prompt's last rollout, or None without history."""
        e = self.entry(prompt_id)
        return None if e is None else e.rollouts[-1].lengths

    def prompt_ids(self) -> list[int]:
        """Prompt ids with history, in insertion order."""
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, prompt_id) -> bool:
        with self._lock:
            return int(prompt_id) in self._entries

    # ---------------------------------------------------------------- persistence

    def _arrays(self) -> dict[str, np.ndarray]:
        with self._lock:
            items = list(self._entries.items())
            version = self.version
        pids = np.array([p for p, _ in items], dtype=np.int64)
        prompts = [e.prompt for _, e in items]
        rollouts = [ro for _, e in items for ro in e.rollouts]
        samples = [r for ro in rollouts for r in ro.responses]

        def offsets(sizes) -> np.ndarray:
            out = np.zeros(len(sizes) + 1, dtype=np.int64)
            np.cumsum(np.asarray(sizes, dtype=np.int64), out=out[1:])
            return out

        def cat(arrays, dtype) -> np.ndarray:
            return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)

        return {
            "prompt_ids": pids,
            "prompt_offsets": offsets([p.size for p in prompts]),
            "prompt_tokens": cat(prompts, np.int32),
            "rollout_offsets": offsets([len(e.rollouts) for _, e in items]),
            "rollout_steps": np.array([ro.step for ro in rollouts], dtype=np.int64),
            "sample_offsets": offsets([len(ro.responses) for ro in rollouts]),
            "rewards": cat([ro.rewards for ro in rollouts], np.float32),
            "lengths": cat([ro.lengths for ro in rollouts], np.int32),
            "token_offsets": offsets([r.size for r in samples]),
            "tokens": cat(samples, np.int32),
            "depth": np.array(self.depth, dtype=np.int64),
            "version": np.array(version, dtype=np.int64),
        }

    def save(self, path: str | Path) -> Path:
        """Write the store to one ``.npz`` atomically (a crash mid-write leaves the old file).

        Returns:
          The path written.
        """
        path = Path(path)
        arrays = self._arrays()
        with atomic_write(path, "wb") as fh:
            _write_npz(fh, arrays)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "HistoryStore":
        """Read a store written by ``save``.

        Raises:
          HistoryError: the file is missing or unreadable, an array is missing, or the arrays are
            inconsistent (the message names the path and the field).
        """
        path = Path(path)
        if not path.is_file():
            raise HistoryError(f"{path}: no history file")
        return _parse(str(path), path)

    def to_bytes(self) -> bytes:
        """The ``save`` file contents as bytes (for checkpoint blobs)."""
        buf = io.BytesIO()
        _write_npz(buf, self._arrays())
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "<bytes>") -> "HistoryStore":
        """Inverse of ``to_bytes``.

        Raises:
          HistoryError: unreadable or inconsistent data (the message names ``source`` and the field).
        """
        return _parse(source, io.BytesIO(data))


def _parse(source: str, fileobj) -> HistoryStore:
    try:
        with np.load(fileobj, allow_pickle=False) as z:
            d = {k: z[k] for k in z.files}
    except Exception as exc:  # noqa: BLE001 - zip/format errors vary; report them uniformly
        raise HistoryError(f"{source}: unreadable history data ({type(exc).__name__}: {exc})") from None
    return _from_arrays(source, d)


def _write_npz(fh, arrays: dict[str, np.ndarray]) -> None:
    """Serialise the arrays into the open file (uncompressed; a separate function so tests can
    simulate a crash part way through)."""
    np.savez(fh, **arrays)


_FIELDS = {  # name: (dtype kind, ndim)
    "prompt_ids": ("i", 1), "prompt_offsets": ("i", 1), "prompt_tokens": ("i", 1),
    "rollout_offsets": ("i", 1), "rollout_steps": ("i", 1), "sample_offsets": ("i", 1),
    "rewards": ("f", 1), "lengths": ("i", 1), "token_offsets": ("i", 1), "tokens": ("i", 1),
    "depth": ("i", 0), "version": ("i", 0),
}


def _check_offsets(path: str, d: dict, name: str, count: int, total: int) -> np.ndarray:
    off = d[name].astype(np.int64)
    if off.shape != (count + 1,) or off[0] != 0 or off[-1] != total or np.any(np.diff(off) < 0):
        raise HistoryError(f"{path}: field {name}: expected {count + 1} non-decreasing offsets from 0 "
                           f"to {total}, got shape {off.shape}")
    return off


def _from_arrays(path: str, d: dict) -> HistoryStore:
    for name, (kind, ndim) in _FIELDS.items():
        if name not in d:
            raise HistoryError(f"{path}: field {name}: missing")
        if d[name].dtype.kind not in (kind, "u" if kind == "i" else kind) or d[name].ndim != ndim:
            raise HistoryError(f"{path}: field {name}: expected a {ndim}-D "
                               f"{'integer' if kind == 'i' else 'float'} array, got {d[name].dtype}{d[name].shape}")
    depth = int(d["depth"])
    if depth < 1:
        raise HistoryError(f"{path}: field depth: expected >= 1, got {depth}")
    pids = d["prompt_ids"].astype(np.int64)
    n_p = pids.shape[0]
    if np.unique(pids).size != n_p:
        raise HistoryError(f"{path}: field prompt_ids: duplicate ids")
    p_off = _check_offsets(path, d, "prompt_offsets", n_p, d["prompt_tokens"].shape[0])
    n_r = d["rollout_steps"].shape[0]
    r_off = _check_offsets(path, d, "rollout_offsets", n_p, n_r)
    if n_p and (np.diff(r_off).min() < 1 or np.diff(r_off).max() > depth):
        raise HistoryError(f"{path}: field rollout_offsets: each prompt needs 1..{depth} rollouts")
    n_s = d["rewards"].shape[0]
    s_off = _check_offsets(path, d, "sample_offsets", n_r, n_s)
    if d["lengths"].shape != (n_s,):
        raise HistoryError(f"{path}: field lengths: expected shape ({n_s},), got {d['lengths'].shape}")
    t_off = _check_offsets(path, d, "token_offsets", n_s, d["tokens"].shape[0])
    if not np.array_equal(np.diff(t_off), d["lengths"]):
        raise HistoryError(f"{path}: field lengths: disagree with token_offsets")
    if not np.all(np.isfinite(d["rewards"])):
        raise HistoryError(f"{path}: field rewards: non-finite values")
    for name in ("prompt_tokens", "tokens"):
        if d[name].size and d[name].min() < 0:
            raise HistoryError(f"{path}: field {name}: negative token ids")

    store = HistoryStore(depth)
    tokens, rewards = d["tokens"].astype(np.int32), d["rewards"].astype(np.float32)
    for p in range(n_p):
        rollouts = []
        for r in range(r_off[p], r_off[p + 1]):
            rows = range(s_off[r], s_off[r + 1])
            rollouts.append(_make_rollout(int(d["rollout_steps"][r]),
                                          [tokens[t_off[i]:t_off[i + 1]] for i in rows],
                                          rewards[s_off[r]:s_off[r + 1]]))
        prompt = _frozen(d["prompt_tokens"][p_off[p]:p_off[p + 1]].astype(np.int32))
        store._entries[int(pids[p])] = HistoryEntry(prompt, tuple(rollouts))
    store.version = int(d["version"])
    return store
