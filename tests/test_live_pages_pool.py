"""Guard (issue 50, CPU): the decode, verify and chunk programs that ``live_pages`` serves (the CPU's
``auto`` attention) never copy or slice the KV pool. Each program is compiled for this CPU and its
optimised HLO is read: no ``copy``, ``slice``, ``dynamic-slice`` or ``gather`` may produce as many
elements as one layer's pool (what ``pool[layer]`` handed to an attention call would cost per layer);
the pool is written in place and read through gathers of live pages only: with 2-page tables (one
block of the walk holds the table) and 132-page tables (the walk takes several blocks)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.ragged_paged_attention import live_pages
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


# (page_size, num_pages, max_new_tokens): tables of 2 pages (one block) or of 132 (several)
SIZES = {"one_block": (16, 64, 8), "blocks": (4, 300, 512)}


def _programs(impl: str, unroll: int, sizes: str = "one_block"):
    """``(engine, [(shape, optimised HLO text)])``: at the widest page table of a 2-slot engine with
    attention ``impl`` and 4 passes a dispatch, the decode program, the largest verify program, the
    plain chunk and the largest HistoSpec chunk, compiled for this CPU."""
    page_size, num_pages, new = SIZES[sizes]
    graphdef, state = nnx.split(Decoder(CFG, dtype=jnp.float32, scan_unroll=unroll, rngs=nnx.Rngs(0)))
    eng = RolloutEngine(graphdef, CFG, EngineConfig(max_slots=2, page_size=page_size, num_pages=num_pages,
                                                    max_prompt_len=16, max_new_tokens=new, eos_ids=(),
                                                    attention_impl=impl, passes_per_dispatch=4))
    runner = eng.runner(state, SamplingParams(temperature=1.0, max_new_tokens=new))
    progs = [s for s in eng.programs(spec=True) if s.kind != "prefill" and s.rows == 2]
    progs = [s for s in progs if s.width == max(p.width for p in progs)]
    picked = [min(progs, key=lambda s: (s.kind != "decode", s.tokens))]
    picked += [max((s for s in progs if s.kind == kind), key=lambda s: s.tokens) for kind in ("verify", "chunk", "spec_chunk")]
    assert [s.kind for s in picked] == ["decode", "verify", "chunk", "spec_chunk"]
    return eng, [(s, runner.lower(runner.inputs(s)).compile().as_text()) for s in picked]


@pytest.mark.parametrize("sizes", ["one_block", "blocks"])
@pytest.mark.parametrize("unroll", [1, 3])
def test_pass_programs_never_copy_a_layer_of_the_pool(unroll, sizes):
    eng, programs = _programs("auto", unroll, sizes)
    assert eng.attention_impl == "live_pages"
    _, kvh, pages, ps, hd = eng.kv.k.shape
    layer_elems = kvh * pages * ps * hd
    for shape, hlo in programs:
        groups = shape.rows * -(-shape.width // live_pages.group_pages(shape.width))
        assert (live_pages.block_groups(shape.rows, shape.width, ps, shape.q_len) < groups) == (sizes == "blocks")
        assert "while" in hlo, shape  # the walk
        assert _big_moves(hlo, layer_elems) == [], shape


def test_the_guard_sees_the_references_per_layer_slice():
    """The reference reads ``pool[layer]``: its scanned decode program slices a layer of the pool
    (the guard above would fail on it)."""
    eng, programs = _programs("reference", 1)
    _, kvh, pages, ps, hd = eng.kv.k.shape
    assert _big_moves(programs[0][1], kvh * pages * ps * hd)
