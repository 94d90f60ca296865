"""Smoke check of ``rhyme_lab.measure.pass_cost`` (``python -m benchmarks.pass_cost``: decode vs
verify pass cost): it builds the passes the engine would run and writes its report. Nothing is
timed here (timings belong in the benchmark)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rhyme_lab.measure import pass_cost
from rhyme_jax.rollout import batching


@pytest.mark.slow  # CI time (12 s); the bucket tests here run the same timing code
def test_pass_cost_passes_and_report(tmp_path):
    # the benchmark's --rows 4 --context 20 --drafts 0,2 --iters 1 --attention reference --passes-ratio 1.5
    ks = pass_cost.parse_drafts("0,2")
    eng, state = pass_cost.pass_engine(pass_cost.model_config("demo"), "float32", 4, 20, max(ks), "reference")
    res = pass_cost.pass_costs(eng, state, ks, 4, 20, iters=1, log=None)
    meta = pass_cost.run_meta("demo", "float32", 4, 20, eng, state)
    table = pass_cost.cost_table(meta, res, passes_ratio=1.5)
    report = json.loads(pass_cost.write_cost_report(tmp_path, "demo", meta, res, table).read_text())
    res = report["results"]
    assert [r["k"] for r in res] == [0, 2]
    rows = batching.seq_bucket(4, 4)
    assert [r["tokens"] for r in res] == [rows, rows * 3]  # every row: pending token + its drafts
    assert res[0]["relative"] == 1.0
    assert report["meta"]["params"] > 0 and "implied speed-up" in (tmp_path / "pass_cost_demo.md").read_text()
    with pytest.raises(ValueError, match="--drafts"):
        pass_cost.parse_drafts("0,64")  # beyond the largest draft bucket


def test_pass_inputs_give_every_sequence_its_own_pages():
    from flax import nnx
    from rhyme_jax.model.transformer import Decoder
    from rhyme_jax.rollout.engine import EngineConfig, RolloutEngine

    graphdef, _ = nnx.split(Decoder(pass_cost.DEMO, rngs=nnx.Rngs(0)))
    eng = RolloutEngine(graphdef, pass_cost.DEMO, EngineConfig(max_slots=3, page_size=16, num_pages=0,
                                                                max_prompt_len=40, max_new_tokens=4, eos_ids=[]))
    inp, t = pass_cost.pass_inputs(eng, 3, 40, 1, np.random.default_rng(0))
    assert t >= 3 * 2
    held = eng.allocator.num_held[:3]
    assert (held == eng.allocator.pages_for(40 + 2)).all()
    pages = np.concatenate([eng.allocator.page_table[s, :held[s]] for s in range(3)])
    assert np.unique(pages).size == pages.size and (pages > 0).all()


def test_buckets_fill_each_program_exactly():
    """``--buckets``: drafts spread evenly so a (rows, tokens) program packs exactly its tokens;
    a pair that is not one of the engine's programs is refused before any compile."""
    eng, _ = pass_cost.pass_engine(pass_cost.DEMO, "float32", 4, 32, 3, "reference", verify_tokens=16)
    # 4 slots, verify budget 16: verify_pairs(4) = (6, Q 3), (16, Q 9); decode (4, 1)
    assert pass_cost.bucket_drafts(eng, 4, 4).tolist() == [0, 0, 0, 0]
    assert pass_cost.bucket_drafts(eng, 4, 6).tolist() == [1, 1, 0, 0]
    assert pass_cost.bucket_drafts(eng, 4, 16).tolist() == [3, 3, 3, 3]
    inp, t = pass_cost.pass_inputs(eng, 4, 32, pass_cost.bucket_drafts(eng, 4, 6), np.random.default_rng(0))
    assert t == 6 and inp.max_q_len == 3 and inp.tokens.shape == (6,)
    with pytest.raises(ValueError, match=r"\(4, 5\) is not a decode/verify program"):
        pass_cost.bucket_drafts(eng, 4, 5)
    assert pass_cost.parse_buckets("4x4,64x256") == [(4, 4), (64, 256)]
    for bad in ("4x3", "4", "ax4", ""):
        with pytest.raises(ValueError, match="--buckets"):
            pass_cost.parse_buckets(bad)
