"""Smoke check of benchmarks/step_cost.py (decode vs verify pass cost): it builds the passes the
engine would run and writes its report. Nothing is timed here (timings belong in the benchmark)."""

from __future__ import annotations

import json

import numpy as np

from rhyme_jax.rollout import batching


def test_step_cost_passes_and_report(tmp_path, benchmark_module):
    bench = benchmark_module("step_cost")
    assert bench.main(["--rows", "4", "--context", "20", "--drafts", "0,2", "--iters", "1",
                       "--attention", "reference", "--passes-ratio", "1.5", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "step_cost_demo.json").read_text())
    res = report["results"]
    assert [r["k"] for r in res] == [0, 2]
    rows = batching.seq_bucket(4, 4)
    assert [r["tokens"] for r in res] == [rows, rows * 3]  # every row: pending token + its drafts
    assert res[0]["relative"] == 1.0
    assert report["meta"]["params"] > 0 and "implied speed-up" in (tmp_path / "step_cost_demo.md").read_text()
    assert bench.main(["--drafts", "0,64", "--out", str(tmp_path)]) == 2  # beyond the largest draft bucket


def test_pass_inputs_give_every_sequence_its_own_pages(benchmark_module):
    bench = benchmark_module("step_cost")
    from flax import nnx
    from rhyme_jax.model.transformer import Decoder
    from rhyme_jax.rollout.engine import RolloutEngine

    graphdef, _ = nnx.split(Decoder(bench.DEMO, rngs=nnx.Rngs(0)))
    eng = RolloutEngine(graphdef, bench.DEMO, max_slots=3, page_size=16, num_pages=0, max_prompt_len=40,
                        max_new_tokens=4, eos_ids=[])
    inp, t = bench.pass_inputs(eng, 3, 40, 1, np.random.default_rng(0))
    assert t >= 3 * 2
    held = eng.allocator.num_held[:3]
    assert (held == eng.allocator.pages_for(40 + 2)).all()
    pages = np.concatenate([eng.allocator.page_table[s, :held[s]] for s in range(3)])
    assert np.unique(pages).size == pages.size and (pages > 0).all()
