"""Orbax checkpoints of params, optimizer state and run metadata.

Layout: ``<directory>/<step>/{params,opt_state,meta[,blobs]}`` managed by
``orbax.checkpoint.CheckpointManager``. Orbax writes each step into a temporary
``<step>.orbax-checkpoint-tmp-*`` directory and renames it only after every item is complete, so a
process killed mid-save leaves at most a tmp directory, which is never listed as a step (and is
removed by the next ``Checkpointer``); the previous complete step still restores.

Pytrees are stored as nested dicts keyed by their jax key paths (``layers/attn/q/kernel/value``),
so any pytree (``nnx.State``, optax named tuples, ``EmptyState``) round-trips exactly, and restore
rebuilds the caller's structure from ``*_like`` (abstract ``jax.ShapeDtypeStruct`` trees or
concrete arrays; their shardings are used when present).

Checkpoints written before the decoder's blocks were stacked (``layers/0/...``, ``layers/1/...``:
one subtree per block) are converted on restore: every ``layers`` dict keyed ``0 .. L-1`` is
stacked into one ``[L, ...]`` subtree (params and the optimizer's moments alike).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

_ITEMS = ("params", "opt_state", "meta")
_OPTIONAL = ("blobs",)  # named byte strings (e.g. the HistoSpec history store)
_EMPTY = "__empty__"
_COMMIT_FILE = "commit_success.txt"  # orbax atomicity.COMMIT_SUCCESS_FILE


def is_complete(step_dir: Path) -> bool:
    """Whether a checkpoint step directory is complete: orbax's commit marker (written just before
    the atomic rename) and every item are there; a stray or hand-made directory is not."""
    return (step_dir / _COMMIT_FILE).is_file() and all((step_dir / item).is_dir() for item in _ITEMS)


def complete_steps(checkpoint_dir: str | Path) -> list[int]:
    """Complete checkpoint steps under ``checkpoint_dir`` (``<run>/checkpoints``), ascending, read
    without opening a ``CheckpointManager`` (which may clean up the temporary directory of a save
    in progress): safe beside a run that is still training."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    return sorted(int(d.name) for d in root.iterdir() if d.name.isdigit() and is_complete(d))


class CheckpointError(RuntimeError):
    """A checkpoint is missing, or does not match the structure it is restored into."""


def _key_str(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _to_nested(tree: Any) -> dict:
    """Nested ``{str: ... array}`` dict of a pytree's leaves keyed by their paths."""
    out: dict = {}
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves:
        return {_EMPTY: np.zeros((), np.int8)}
    for path, leaf in leaves:
        keys = [_key_str(k) for k in path] or ["__root__"]
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise CheckpointError(f"checkpoint: pytree path {keys} collides with a leaf")
        if keys[-1] in node:
            raise CheckpointError(f"checkpoint: duplicate pytree path {'/'.join(keys)}")
        node[keys[-1]] = leaf
    return out


def _abstract(leaf) -> jax.ShapeDtypeStruct:
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
    return jax.ShapeDtypeStruct(np.shape(leaf), dtype, sharding=sharding)


def _from_nested(nested: dict, like: Any, what: str) -> Any:
    """Rebuild ``like``'s structure from a nested dict written by ``_to_nested``."""
    leaves = jax.tree_util.tree_leaves_with_path(like)
    treedef = jax.tree_util.tree_structure(like)
    values = []
    for path, leaf in leaves:
        keys = [_key_str(k) for k in path] or ["__root__"]
        node = nested
        for k in keys:
            if not isinstance(node, dict) or k not in node:
                raise CheckpointError(
                    f"checkpoint: {what} has no entry {'/'.join(keys)} (the model or optimizer "
                    f"structure differs from the one saved)"
                )
            node = node[k]
        if tuple(np.shape(node)) != tuple(np.shape(leaf)):
            raise CheckpointError(
                f"checkpoint: {what} entry {'/'.join(keys)} has shape {np.shape(node)}, expected {np.shape(leaf)}"
            )
        values.append(node)
    return jax.tree_util.tree_unflatten(treedef, values)


def _per_block_layers(node: Any) -> bool:
    """Whether a nested checkpoint tree holds per-block ``layers/<i>/...`` subtrees."""
    if not isinstance(node, dict):
        return False
    for key, child in node.items():
        if key == "layers" and isinstance(child, dict) and child and all(k.isdigit() for k in child):
            return True
        if _per_block_layers(child):
            return True
    return False


def stack_block_layers(node: Any) -> Any:
    """Convert a nested tree with per-block ``layers/<i>/...`` subtrees to stacked ``layers/...``
    leaves ``[L, ...]`` (``transformer.stack_layers``'s layout); other entries are unchanged.

    Raises:
      CheckpointError: the blocks are not numbered ``0 .. L-1`` or their subtrees differ.
    """
    if not isinstance(node, dict):
        return node
    out = {}
    for key, child in node.items():
        if key == "layers" and isinstance(child, dict) and child and all(k.isdigit() for k in child):
            idx = sorted(int(k) for k in child)
            if idx != list(range(len(idx))):
                raise CheckpointError(f"checkpoint: per-block layers are numbered {idx}, expected 0..{len(idx) - 1}")
            blocks = [child[str(i)] for i in idx]
            try:
                out[key] = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *blocks)
            except ValueError as exc:
                raise CheckpointError(f"checkpoint: per-block layers differ in structure: {exc}") from exc
        else:
            out[key] = stack_block_layers(child)
    return out


def _restore_per_block(item_dir: Path, like: Any, what: str) -> Any | None:
    """Restore an item written with per-block ``layers/<i>`` into ``like``'s stacked layout, or
    None when ``item_dir`` is not such a checkpoint. Arrays pass through the host once."""
    ckptr = ocp.StandardCheckpointer()
    try:
        meta = ckptr.metadata(item_dir)
        tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
        if not _per_block_layers(tree):
            return None
        host = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=host), tree)
        nested = ckptr.restore(item_dir, target)
    finally:
        ckptr.close()
    values = _from_nested(stack_block_layers(nested), like, what)
    return jax.tree.map(lambda v, l: jax.device_put(np.asarray(v).astype(_abstract(l).dtype), _abstract(l).sharding),
                        values, like)


def _restore_args(like: Any) -> Any:
    """Abstract nested target for orbax from a ``*_like`` tree."""
    if not jax.tree_util.tree_leaves(like):
        return {_EMPTY: jax.ShapeDtypeStruct((), np.int8, sharding=_abstract(np.zeros(())).sharding)}
    return _to_nested(jax.tree.map(_abstract, like))


class Checkpointer:
    """Keeps the last ``keep`` complete checkpoints of a run under ``directory``.

    Args:
      directory: run checkpoint directory (created if missing).
      keep: number of most recent steps kept; older ones are deleted after each save (>= 1).

    Raises:
      CheckpointError: ``keep < 1``.
    """

    def __init__(self, directory: str | Path, *, keep: int = 2):
        if keep < 1:
            raise CheckpointError(f"checkpoint: keep must be >= 1, got {keep} (run.keep_checkpoints)")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, cleanup_tmp_directories=True, enable_async_checkpointing=False
        )
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS + _OPTIONAL)

    def save(self, step: int, *, params: Any, opt_state: Any, meta: dict,
             blobs: dict[str, bytes] | None = None) -> None:
        """Write step ``step`` and block until it is complete on disk.

        Args:
          step: non-negative step number (directory name). An existing checkpoint of the same
            step is deleted first and replaced.
          params: parameter pytree (e.g. ``nnx.State`` of ``nnx.Param``).
          opt_state: optax state pytree.
          meta: JSON-serialisable dict (step, RNG key data as a list, data position, counters).
          blobs: optional named byte strings saved in the same atomic step (read back with
            ``restore_blobs``), e.g. the serialised history store.

        Raises:
          CheckpointError: ``meta`` is not JSON-serialisable or ``step`` is negative.
        """
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint: meta must be JSON-serialisable: {exc}") from None
        if step < 0:
            raise CheckpointError(f"checkpoint: step must be >= 0, got {step}")
        self._mgr.reload()
        if step in self._mgr.all_steps():
            self._mgr.delete(int(step))
        items = dict(params=ocp.args.StandardSave(_to_nested(params)),
                     opt_state=ocp.args.StandardSave(_to_nested(opt_state)),
                     meta=ocp.args.JsonSave(meta))
        if blobs:
            items["blobs"] = ocp.args.StandardSave(
                {name: np.frombuffer(b"\x00" + bytes(data), np.uint8) for name, data in blobs.items()})
        self._mgr.save(int(step), args=ocp.args.Composite(**items), force=True)
        self._mgr.wait_until_finished()

    def all_steps(self) -> list[int]:
        """Complete steps on disk, ascending.

        A step counts only when its directory holds orbax's commit marker (written just before
        the atomic rename) and every item; a stray or hand-made directory is ignored.
        """
        self._mgr.reload()
        return sorted(int(step) for step in self._mgr.all_steps() if is_complete(self.directory / str(step)))

    def latest_step(self) -> int | None:
        """Newest complete step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, step: int | None, *, params_like: Any, opt_state_like: Any) -> tuple[Any, Any, dict]:
        """Read a checkpoint into the structures of ``params_like`` / ``opt_state_like``.

        Args:
          step: step to restore; None = the latest.
          params_like, opt_state_like: pytrees (abstract or concrete) giving structure, shapes,
            dtypes and shardings of the result. ``opt_state_like=None`` skips reading the
            optimizer state (evaluation) and returns None for it.

        Returns:
          (params, opt_state, meta) with the ``*_like`` structures and ``meta`` as saved.

        Raises:
          CheckpointError: no checkpoint, unknown step, or structure mismatch.
        """
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"checkpoint: no complete checkpoint in {self.directory}")
            step = steps[-1]
        if step not in steps:
            raise CheckpointError(f"checkpoint: step {step} not in {self.directory} (have {steps})")
        items = {
            "params": ocp.args.StandardRestore(_restore_args(params_like)),
            "meta": ocp.args.JsonRestore(),
        }
        if opt_state_like is not None:
            items["opt_state"] = ocp.args.StandardRestore(_restore_args(opt_state_like))
        step_dir = self.directory / str(step)
        legacy = _restore_per_block(step_dir / "params", params_like, f"{step_dir}/params")
        if legacy is not None:  # written before the blocks were stacked: converted on the host
            opt = None if opt_state_like is None else _restore_per_block(
                step_dir / "opt_state", opt_state_like, f"{step_dir}/opt_state")
            meta = self._mgr.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            return legacy, opt, dict(meta["meta"])
        try:
            out = self._mgr.restore(int(step), args=ocp.args.Composite(**items))
        except (ValueError, KeyError, TypeError, FileNotFoundError) as exc:
            raise CheckpointError(
                f"checkpoint: cannot restore {self.directory}/{step} into the given structure: {exc}"
            ) from exc
        params = _from_nested(out["params"], params_like, f"{self.directory}/{step}/params")
        opt_state = None
        if opt_state_like is not None:
            opt_state = _from_nested(out["opt_state"], opt_state_like, f"{self.directory}/{step}/opt_state")
        return params, opt_state, dict(out["meta"])

    def restore_blobs(self, step: int | None = None) -> dict[str, bytes]:
        """The ``blobs`` saved with a step (``{}`` when it has none).

        Raises:
          CheckpointError: no such complete step.
        """
        steps = self.all_steps()
        step = steps[-1] if step is None and steps else step
        if step not in steps:
            raise CheckpointError(f"checkpoint: step {step} not in {self.directory} (have {steps})")
        if not (self.directory / str(step) / "blobs").is_dir():
            return {}
        out = self._mgr.restore(int(step), args=ocp.args.Composite(blobs=ocp.args.StandardRestore()))
        # A leading 0 byte keeps every array non-empty (an empty blob is still stored).
        return {name: np.asarray(arr, np.uint8).tobytes()[1:] for name, arr in out["blobs"].items()}

    def close(self) -> None:
        """Wait for pending work and release the manager."""
        self._mgr.wait_until_finished()
        self._mgr.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def save_params(path: str | Path, params: Any) -> None:
    """Write a params-only checkpoint to ``path`` (atomic; replaces an existing one).

    Used for SFT warm starts (``run.init_from``). Blocks until complete.
    """
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(Path(path).absolute(), _to_nested(params), force=True)
    ckptr.wait_until_finished()
    ckptr.close()


def load_params(path: str | Path, params_like: Any) -> Any:
    """Read a ``save_params`` checkpoint into the structure of ``params_like``.

    ``path`` may also be a directory holding a ``params/`` checkpoint (``<run>/sft`` or
    ``<run>/checkpoints/<step>``).

    Raises:
      CheckpointError: ``path`` is missing or its contents do not match ``params_like``.
    """
    path = Path(path).absolute()
    if not path.is_dir():
        raise CheckpointError(f"checkpoint: params checkpoint {path} does not exist")
    if (path / "params").is_dir():
        # A run's sft/ directory or a GRPO checkpoints/<step>/ directory: take its params.
        path = path / "params"
    legacy = _restore_per_block(path, params_like, str(path))
    if legacy is not None:  # written before the blocks were stacked: converted on the host
        return legacy
    ckptr = ocp.StandardCheckpointer()
    absl = logging.getLogger("absl")
    level = absl.level
    # A params item inside a managed step has its metadata one level up: orbax warns, harmlessly.
    absl.setLevel(logging.ERROR)
    try:
        nested = ckptr.restore(path, _restore_args(params_like))
    except (ValueError, KeyError, TypeError, FileNotFoundError) as exc:
        raise CheckpointError(f"checkpoint: cannot restore {path} into the given structure: {exc}") from exc
    finally:
        absl.setLevel(level)
        ckptr.close()
    return _from_nested(nested, params_like, str(path))
