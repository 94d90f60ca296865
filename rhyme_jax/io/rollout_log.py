"""Per-step rollout archive: ``<run_dir>/rollouts/step_{step:06d}.npz``, written atomically.

Ragged responses are stored flat (CSR layout): ``tokens`` is the int32 concatenation of all
responses and ``offsets`` (int64, N+1) delimits response i as ``tokens[offsets[i]:offsets[i+1]]``.
Optional behaviour-policy logprobs use the same offsets (``logprobs``, float32).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from jaxtyping import Float, Int

from rhyme_jax.io.atomic import atomic_write

ROLLOUT_DIR = "rollouts"
_STEP_FILE = re.compile(r"^step_(\d{6,})\.npz$")


class RolloutLogError(ValueError):
    """Inconsistent rollout arrays or a missing/corrupt rollout file (message names the field/path)."""


def rollout_path(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/rollouts/step_{step:06d}.npz``."""
    return Path(run_dir) / ROLLOUT_DIR / f"step_{int(step):06d}.npz"


def save_rollouts(
    run_dir: str | Path,
    step: int,
    prompt_ids: Int[np.ndarray, "N"],
    responses: list[Int[np.ndarray, "L"]],
    rewards: Float[np.ndarray, "N"],
    behaviour_logprobs: list[Float[np.ndarray, "L"]] | None = None,
) -> Path:
    """Save one step's N rollouts atomically (temp file in the same dir, then ``os.replace``).

    Args:
      run_dir: run output directory.
      step: GRPO step (>= 0); an existing file for the step is replaced.
      prompt_ids: ``int64[N]`` problem id of each rollout.
      responses: N 1-D integer token arrays (stored as int32; lengths may be 0).
      rewards: ``float32[N]``.
      behaviour_logprobs: optional N float arrays, each the length of its response.

    Returns:
      The path of the written ``.npz`` (arrays: prompt_ids, rewards, lengths, tokens, offsets
      [, logprobs]).

    Raises:
      RolloutLogError: negative step, or array counts/shapes that disagree (names the field).
    """
    if int(step) < 0:
        raise RolloutLogError(f"step must be >= 0, got {step}")
    prompt_ids = np.asarray(prompt_ids, dtype=np.int64)
    rewards = np.asarray(rewards, dtype=np.float32)
    n = len(responses)
    if prompt_ids.shape != (n,):
        raise RolloutLogError(f"prompt_ids: expected shape ({n},) for {n} responses, got {prompt_ids.shape}")
    if rewards.shape != (n,):
        raise RolloutLogError(f"rewards: expected shape ({n},) for {n} responses, got {rewards.shape}")
    resp = [np.asarray(r) for r in responses]
    for i, r in enumerate(resp):
        if r.ndim != 1 or (r.size and not np.issubdtype(r.dtype, np.integer)):
            raise RolloutLogError(f"responses[{i}]: expected a 1-D integer array, got {r.dtype}{r.shape}")
    lengths = np.array([r.size for r in resp], dtype=np.int32)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    arrays = {
        "prompt_ids": prompt_ids,
        "rewards": rewards,
        "lengths": lengths,
        "tokens": np.concatenate(resp).astype(np.int32) if n else np.zeros(0, np.int32),
        "offsets": offsets,
    }
    if behaviour_logprobs is not None:
        if len(behaviour_logprobs) != n:
            raise RolloutLogError(f"behaviour_logprobs: expected {n} arrays, got {len(behaviour_logprobs)}")
        lps = [np.asarray(lp, dtype=np.float32).reshape(-1) for lp in behaviour_logprobs]
        for i, lp in enumerate(lps):
            if lp.size != lengths[i]:
                raise RolloutLogError(
                    f"behaviour_logprobs[{i}]: length {lp.size} != response length {lengths[i]}")
        arrays["logprobs"] = np.concatenate(lps) if n else np.zeros(0, np.float32)

    out = rollout_path(run_dir, step)
    with atomic_write(out, "wb") as fh:
        np.savez_compressed(fh, **arrays)
    return out


def load_rollouts(run_dir: str | Path, step: int) -> dict:
    """Load one step's rollouts saved by ``save_rollouts``.

    Returns:
      ``{"prompt_ids": int64[N], "rewards": float32[N], "lengths": int32[N],
      "responses": list of N int32 arrays}`` plus ``"behaviour_logprobs"`` (list of float32
      arrays) when they were saved.

    Raises:
      RolloutLogError: the file is missing, unreadable, or its arrays are inconsistent.
    """
    path = rollout_path(run_dir, step)
    if not path.is_file():
        raise RolloutLogError(f"{path}: no rollouts saved for step {step}")
    try:
        with np.load(path) as z:
            data = {k: z[k] for k in z.files}
    except Exception as exc:  # noqa: BLE001 - zipfile/pickle errors vary; report them uniformly
        raise RolloutLogError(f"{path}: unreadable rollout file ({exc})") from None
    missing = {"prompt_ids", "rewards", "lengths", "tokens", "offsets"} - data.keys()
    if missing:
        raise RolloutLogError(f"{path}: missing arrays {sorted(missing)}")
    off, n = data["offsets"], data["prompt_ids"].shape[0]
    if off.shape != (n + 1,) or off[-1] != data["tokens"].shape[0] or not np.array_equal(np.diff(off), data["lengths"]):
        raise RolloutLogError(f"{path}: offsets/lengths/tokens are inconsistent")
    out = {
        "prompt_ids": data["prompt_ids"],
        "rewards": data["rewards"],
        "lengths": data["lengths"],
        "responses": [data["tokens"][off[i] : off[i + 1]] for i in range(n)],
    }
    if "logprobs" in data:
        out["behaviour_logprobs"] = [data["logprobs"][off[i] : off[i + 1]] for i in range(n)]
    return out


def list_rollout_steps(run_dir: str | Path) -> list[int]:
    """Steps with a saved rollout file, ascending (``[]`` if none; temp files are ignored)."""
    d = Path(run_dir) / ROLLOUT_DIR
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _STEP_FILE.match(p.name)))
