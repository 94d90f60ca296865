"""rhyme_jax/spec/kernel_cache.py: stale numba kernels are dropped when a kernel source changes."""

from rhyme_jax.spec import kernel_cache


def test_changed_source_drops_cached_kernels_once(tmp_path):
    pkg = tmp_path / "spec"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "calibration.py").write_text("A = 1\n")
    (pkg / "goodput.py").write_text("B = 2\n")
    cached = [pkg / "__pycache__" / "goodput.draft_kernel-60.py311.nbi",
              pkg / "__pycache__" / "goodput.draft_kernel-60.py311.1.nbc"]
    other = pkg / "__pycache__" / "goodput.cpython-311.pyc"
    for f in cached + [other]:
        f.write_bytes(b"x")
    assert kernel_cache.refresh(pkg)  # no stamp yet: start clean
    assert not any(f.exists() for f in cached) and other.exists()
    for f in cached:
        f.write_bytes(b"x")
    assert not kernel_cache.refresh(pkg)  # same sources: kept
    assert all(f.exists() for f in cached)
    (pkg / "calibration.py").write_text("A = 3\n")  # only the callee changed
    assert kernel_cache.refresh(pkg)
    assert not any(f.exists() for f in cached) and other.exists()
