"""Guard (issue 50, CPU): the decode and verify programs that ``live_pages`` serves (the CPU's
``auto`` attention) never copy or slice the KV pool. Each program is compiled for this CPU and its
optimised HLO is read: no ``copy``, ``slice``, ``dynamic-slice`` or ``gather`` may produce as many
elements as one layer's pool (what ``pool[layer]`` handed to an attention call would cost per layer);
the pool is written in place and read through gathers of live pages only."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rhyme_jax.model.config import ModelConfig
from rhyme_jax.model.transformer import Decoder
from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine
from rhyme_jax.rollout.types import SamplingParams

CFG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16)
_OP = re.compile(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+(copy|slice|dynamic-slice|gather)\(")


def _big_moves(hlo: str, elems: int) -> list[str]:
    """Lines of ``hlo`` whose copy / slice / gather output holds at least ``elems`` elements."""
    out = []
    for line in hlo.splitlines():
        m = _OP.search(line)
        if m and m.group(2) and int(np.prod([int(d) for d in m.group(2).split(",")])) >= elems:
            out.append(line.strip())
    return out


def _programs(impl: str, unroll: int):
    """``(engine, [(shape, optimised HLO text)])``: the decode and the largest verify program of a
    2-slot engine with attention ``impl``, compiled for this CPU."""
    graphdef, state = nnx.split(Decoder(CFG, dtype=jnp.float32, scan_unroll=unroll, rngs=nnx.Rngs(0)))
    eng = RolloutEngine(graphdef, CFG, EngineConfig(max_slots=2, page_size=16, num_pages=64, max_prompt_len=16,
                                                    max_new_tokens=8, eos_ids=(), attention_impl=impl))
    runner = eng.runner(state, SamplingParams(temperature=1.0, max_new_tokens=8))
    progs = [s for s in eng.programs(spec=True) if s.kind != "prefill" and s.rows == 2]
    picked = [min(progs, key=lambda s: s.tokens), max(progs, key=lambda s: s.tokens)]
    assert [s.kind for s in picked] == ["decode", "verify"]
    return eng, [(s, runner.lower(runner.inputs(s)).compile().as_text()) for s in picked]


@pytest.mark.parametrize("unroll", [1, 3])
def test_decode_and_verify_programs_never_copy_a_layer_of_the_pool(unroll):
    eng, programs = _programs("auto", unroll)
    assert eng.attention_impl == "live_pages"
    _, kvh, pages, ps, hd = eng.kv.k.shape
    layer_elems = kvh * pages * ps * hd
    for shape, hlo in programs:
        assert "while" in hlo  # the live-page loop (and the layer loop when scanned)
        assert _big_moves(hlo, layer_elems) == [], shape


def test_the_guard_sees_the_references_per_layer_slice():
    """The reference reads ``pool[layer]``: its scanned decode program slices a layer of the pool
    (the guard above would fail on it)."""
    eng, programs = _programs("reference", 1)
    _, kvh, pages, ps, hd = eng.kv.k.shape
    assert _big_moves(programs[0][1], kvh * pages * ps * hd)
