"""Continuous-batching rollout engine over a paged KV pool.

Its place in a GRPO step: docs/architecture.md, "Data flow of one GRPO step".

``max_slots`` fixed decode slots. Each loop iteration admits waiting prompts into free slots with
one packed prefill call, then runs one decode step in which every slot feeds its pending token
plus, with a HistoSpec ``drafter``, a draft of up to 32 history tokens, packed back to back
(``q_len = 1 + draft_len``; inactive slots read and write the scratch page 0). Every shape is a
bucket of ``rhyme_jax.rollout.shapes`` (``self.plan``), so the programs a run compiles are known
from its config (``plan.programs()``). Sampling and lossless draft verification happen on
device; one small device->host transfer per step brings back ``tokens, logprobs [T]`` (packed)
and the number of tokens each row emits. Decode without drafts is the same step with one token
per row; with ``passes_per_dispatch > 1`` and no drafter, up to that many decode steps run in one
device call (``rollout/chunk.py``), same tokens. EOS or the length limit frees a sequence's pages and
its slot is refilled. Pages are allocated lazily when a sequence crosses a page boundary; when
the pool runs dry the most recently admitted running sequence is preempted (its pages freed, it
is requeued and later re-prefilled with prompt + generated-so-far) -- other sequences' pages are
never touched.

The jitted step is a module-level pure function over ``(graphdef static, state, kv donated, ...)``;
its only static arguments are shape-like (bucket sizes) or the sampling program ``mode``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.ragged_paged_attention import api as attention_api
from rhyme_jax.model.precision import cast_floating, dtype_of, with_compute_dtype
from rhyme_jax.parallel.rules import kv_pool_sharding
from rhyme_jax.rollout import allocation, batching, chunk, chunk_spec, shapes
from rhyme_jax.rollout.allocation import PassChoice
from rhyme_jax.rollout.pass_cost import PassCost
from rhyme_jax.rollout.batching import PassInputs
from rhyme_jax.rollout.engine_config import EngineConfig  # noqa: F401 (re-exported with the engine)
from rhyme_jax.rollout.kv_cache import KVCache
from rhyme_jax.rollout.run_weights import rollout_weights
from rhyme_jax.rollout.page_allocator import PageAllocator
from rhyme_jax.rollout.slots import SlotTable
from rhyme_jax.rollout.passes import StaticModel, prefill_pass, verify_pass
from rhyme_jax.rollout.spec_guard import SpecGuard
from rhyme_jax.rollout.pass_runner import PassRunner, profile_pass_cost, use_pass_cost
from rhyme_jax.rollout.types import (  # noqa: F401 (re-exported: the engine's public types)
    Drafter, EngineConfigError, Progress, PromptTooLongError, RolloutResult, SamplingParams, derive_rates)

_WHERE = "rhyme_jax/rollout/engine.py"


class RolloutEngine:
    """Paged, continuously batched generation for one policy (see the module docstring).

    Args:
      graphdef: ``nnx.split(Decoder)[0]``; the state is passed to each ``generate`` call.
      model_cfg: the model's ``ModelConfig`` (num_layers, num_kv_heads, head_dim, vocab_size).
      config: the engine's ``EngineConfig`` (slots, page size, pool, token limits, stop tokens,
        attention, pass budgets; ``EngineConfig.from_run`` for a run).
      mesh: device mesh with a ``tensor`` axis; the attention op runs inside ``shard_map`` over
        it and the KV pool is sharded by KV head over ``tensor``. ``None`` = a one-device mesh
        on ``jax.devices()[0]``.

    The buckets are ``self.plan = shapes.plan(...)`` of the config's sizes; its fields are also
    attributes of the engine (``max_slots``, ``page_size``, ``eos_ids``, ...). With
    ``config.dtype`` the passes run the graph set to compute in it on the given weights cast to it
    (``model.precision``; no copy when they are already) with the KV pool in it: bf16 rollouts
    over float32 master weights.

    Raises:
      EngineConfigError: ``eos_ids`` outside the vocabulary, the pool cannot hold one
        full-length sequence, ``attention_impl`` is unknown or cannot run here, or the mesh has
        no ``tensor`` axis dividing the KV heads (sizes: ``EngineConfig``).
    """

    def __init__(self, graphdef, model_cfg, config: EngineConfig, *, mesh=None):
        c = self.config = config
        try:
            self.attention_impl = attention_api.resolve_name(attention_api.parse_implementation(c.attention_impl))
        except ValueError as exc:
            raise EngineConfigError(f"{_WHERE}: attention_impl: {exc}") from None
        self.mesh = mesh if mesh is not None else jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tensor",))
        if "tensor" not in self.mesh.axis_names or model_cfg.num_kv_heads % self.mesh.shape["tensor"]:
            raise EngineConfigError(f"{_WHERE}: mesh needs a 'tensor' axis dividing num_kv_heads="
                                    f"{model_cfg.num_kv_heads}, got {dict(self.mesh.shape)}")
        self.graphdef, self.model_cfg = graphdef, model_cfg
        self.dtype = dtype_of(c.dtype, f"{_WHERE}: dtype") if c.dtype else None  # None: as given
        self._compute_graph: nnx.GraphDef | None = None  # graphdef computing in self.dtype
        self.max_slots, self.page_size = int(c.max_slots), int(c.page_size)
        self.max_prompt_len, self.max_new_tokens = int(c.max_prompt_len), int(c.max_new_tokens)
        self.eos_ids = c.eos_ids
        bad = [e for e in self.eos_ids if not 0 <= e < model_cfg.vocab_size]
        if bad:
            raise EngineConfigError(f"{_WHERE}: eos_ids {bad} outside [0, vocab_size={model_cfg.vocab_size})")
        self.on_overlong_prompt = c.on_overlong_prompt
        self.share_prompt_prefix = bool(c.share_prompt_prefix)
        self.draft_history = int(c.draft_history)
        self.max_seq_len = c.max_seq_len
        self.pages_per_seq = -(-self.max_seq_len // self.page_size)
        self.num_pages = int(c.num_pages) or self.max_slots * self.pages_per_seq + 1
        if self.num_pages - 1 < self.pages_per_seq:
            raise EngineConfigError(
                f"{_WHERE}: num_pages={self.num_pages} cannot hold one full-length sequence "
                f"(max_prompt_len + max_new_tokens = {self.max_seq_len} tokens needs "
                f"{self.pages_per_seq} pages of {self.page_size} plus scratch page 0)")
        self.plan = shapes.plan(max_slots=self.max_slots, page_size=self.page_size,
                                max_prompt_len=self.max_prompt_len, max_new_tokens=self.max_new_tokens,
                                max_prefill_tokens=c.max_prefill_tokens, max_verify_tokens=c.max_verify_tokens,
                                passes_per_dispatch=c.passes_per_dispatch, row_buckets=c.row_buckets)
        self.prefill_budget = self.plan.prefill_budget
        self.prefill_buckets = self.plan.prefill_buckets
        self.verify_budget = self.plan.verify_budget
        self.decode_widths = self.plan.widths
        self.allocator = PageAllocator(self.num_pages, self.page_size, self.max_slots, self.pages_per_seq)
        self.kv: KVCache | None = None
        self._pool_dtypes: dict[tuple, Any] = {}  # the state's leaf dtypes -> the KV pool's dtype
        self._static: StaticModel | None = None
        self.check_invariants = False  # tests: run allocator.check() after every pass
        self.programs_run: set[shapes.PassShape] = set()  # every pass program run (within programs())
        # Seconds per decode/verify program, for the goodput allocation of estimated drafts
        # (``profile_pass_cost`` measures it; the prior until then).
        self.pass_cost: PassCost = PassCost.prior()
        # Realized acceptance of HistoSpec chunks per (rows, width): declines chunks that would
        # emit fewer tokens a second than plain decode (rollout/spec_guard.py); one per drafter
        # kind (``_use_guard``), sharing decode's seconds.
        self.spec_guard = SpecGuard()
        self._guards: dict[type, SpecGuard] = {}
        # Host seconds spent blocked fetching pass outputs after their dispatch (device time plus
        # the transfer), summed over every pass this engine ran; ``generate`` reports its share.
        # ``prefill_wait_seconds``: the part of it spent on prefill passes.
        self.device_wait_seconds = 0.0
        self.prefill_wait_seconds = 0.0

    # ------------------------------------------------------------------ helpers
    def _graph(self, state) -> nnx.GraphDef:
        """The graphdef the passes run: ``self.graphdef`` computing in ``self.dtype``."""
        if self.dtype is None:
            return self.graphdef
        if self._compute_graph is None:
            self._compute_graph = with_compute_dtype(self.graphdef, state, self.dtype)
        return self._compute_graph

    def _cast(self, state):
        """``state``'s floating leaves in ``self.dtype`` (the same arrays when they are)."""
        return state if self.dtype is None else cast_floating(state, self.dtype)

    def _flat_state(self, state):
        """The leaves the pass programs take (``state`` cast to ``self.dtype``, per-layer when
        ``config.layer_weights`` splits; made once per weight version: ``run_weights``) and the
        ``StaticModel`` of their structure."""
        run_state = rollout_weights(state, self.dtype, self.config.layer_weights)
        leaves, treedef = jax.tree.flatten(run_state)
        if self._static is None or self._static.value[1] != treedef:
            self._static = StaticModel(self._graph(state), treedef)
        return leaves, self._static

    def programs(self, spec: bool = True) -> list[shapes.PassShape]:
        """Every pass program this engine can compile (``self.plan.programs(spec)``)."""
        return self.plan.programs(spec)

    def warmup(self, state: nnx.State, sampling: SamplingParams, draft_buckets: Sequence[int] = (0,),
               compile_threads: int = 1, *, spec: bool | None = None) -> int:
        """Run every pass program of ``self.programs(spec)`` once for ``sampling``'s program.

        ``spec`` (default: whether ``draft_buckets`` has a nonzero entry, the older spelling)
        adds the verify programs HistoSpec drafting uses. Afterwards ``generate`` with the same
        state structure and sampling mode compiles nothing. The dummy steps only touch scratch
        page 0. With ``compile_threads > 1`` every shape is first compiled ahead of time on that
        many host threads (XLA compiles release the GIL; the step that follows reuses the
        compiled program), so a GPU's step shapes compile in parallel. Returns the number of step
        programs run.
        """
        spec = any(int(k) > 0 for k in draft_buckets) if spec is None else bool(spec)
        runner = self.runner(state, sampling)
        inputs = [runner.inputs(p) for p in self.programs(spec)]
        if compile_threads > 1:
            with ThreadPoolExecutor(compile_threads, thread_name_prefix="rollout-compile") as pool:
                list(pool.map(lambda inp: runner.lower(inp).compile(), inputs))
        for inp in inputs:
            runner.run(inp)
        if spec and self.plan.passes > 1:  # the chunked engine grades declined chunks' tokens (chunk_spec.graded_plain)
            chunk_spec.warm_shadow(self)
        return len(inputs)

    def runner(self, state: nnx.State, sampling: SamplingParams) -> "PassRunner":
        """A ``PassRunner``: this engine's pass programs run or lowered one at a time on given
        inputs (benchmarks, compile reports, profiles), the KV pool created for ``state``."""
        return PassRunner(self, state, sampling)

    def profile_pass_cost(self, state: nnx.State, sampling: SamplingParams, repeats: int = 5) -> PassCost:
        """Measure and set ``self.pass_cost`` (``pass_runner.profile_pass_cost``)."""
        return profile_pass_cost(self, state, sampling, repeats)

    def use_pass_cost(self, state: nnx.State, sampling: SamplingParams, path: str = "") -> PassCost:
        """Set ``self.pass_cost`` from ``path``, the cache or a profile (``pass_runner.use_pass_cost``).

        Raises:
          PassCostError: ``path`` (or a corrupt cache file) cannot be read.
        """
        return use_pass_cost(self, state, sampling, path)

    def _pool_factory(self, state) -> Callable[[], KVCache]:
        """A function creating this engine's zero KV pool in the dtype ``state`` computes in."""
        graph = self._graph(state)
        probe = jax.eval_shape(
            lambda st: nnx.merge(graph, self._cast(st)).embed_tokens(jnp.zeros((1,), jnp.int32)), state)
        cfg = self.model_cfg

        def create():
            return KVCache.create(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                  num_pages=self.num_pages, page_size=self.page_size,
                                  head_dim=cfg.head_dim, dtype=probe.dtype)
        return create

    def abstract_pool(self, state) -> KVCache:
        """The KV pool as ``jax.ShapeDtypeStruct`` leaves (lowering steps without allocating it)."""
        return jax.eval_shape(self._pool_factory(state))

    def _ensure_pool(self, state) -> None:
        # The pool's dtype follows the state's dtypes: traced once per dtype signature (an
        # eval_shape of the model costs ~4 ms of host time, once per call otherwise).
        key = tuple(x.dtype for x in jax.tree.leaves(state))
        if key not in self._pool_dtypes:
            self._pool_dtypes[key] = jax.eval_shape(self._pool_factory(state)).dtype
        if self.kv is None or self.kv.dtype != self._pool_dtypes[key]:
            create = self._pool_factory(state)
            shape = jax.eval_shape(create)
            # Committed to the device like the parameters, so the first and later calls hit
            # the same compiled step.
            # Created in place on the mesh (sharded by KV head): no full pool on one device.
            self.kv = jax.jit(create, out_shardings=kv_pool_sharding(self.mesh, shape.k.shape))()

    def _validate(self, prompts, sampling: SamplingParams) -> list[np.ndarray | None]:
        if sampling.max_new_tokens < 1 or sampling.max_new_tokens > self.max_new_tokens:
            raise EngineConfigError(
                f"{_WHERE}: SamplingParams.max_new_tokens={sampling.max_new_tokens} must be in "
                f"[1, engine max_new_tokens={self.max_new_tokens}]")
        sampling.mode  # validates temperature / top_k / top_p (SamplingError)
        out = []
        vocab = self.model_cfg.vocab_size
        for i, p in enumerate(prompts):
            arr = np.asarray(p, dtype=np.int64).reshape(-1)
            if arr.size == 0:
                raise EngineConfigError(f"{_WHERE}: prompt {i} is empty")
            if arr.min() < 0 or arr.max() >= vocab:
                raise EngineConfigError(f"{_WHERE}: prompt {i} has token ids outside [0, {vocab})")
            if arr.size > self.max_prompt_len:
                if self.on_overlong_prompt == "error":
                    raise PromptTooLongError(
                        f"prompt {i} has {arr.size} tokens, more than max_prompt_len={self.max_prompt_len}")
                out.append(None)
                continue
            out.append(arr.astype(np.int32))
        return out

    def _call(self, flat_state, inp: PassInputs, key, sp, mode):
        """``(jitted step function, positional args, keyword args)`` of one step."""
        leaves, static = flat_state
        scalars = (np.float32(sp.temperature), np.int32(sp.top_k), np.float32(sp.top_p))
        if isinstance(inp, chunk.ChunkInputs):
            return chunk.call(self, flat_state, inp, key, scalars, mode)
        if isinstance(inp, chunk_spec.SpecChunkInputs):
            return chunk_spec.call(self, flat_state, inp, key, scalars, mode)
        kw = dict(max_q_len=inp.max_q_len, mode=mode, attention_impl=self.attention_impl, mesh=self.mesh)
        if isinstance(inp, batching.VerifyInputs):
            return verify_pass, (static, leaves, self.kv, inp.tokens, inp.positions, inp.meta, inp.streams, key,
                                    *scalars), kw
        return prefill_pass, (static, leaves, self.kv, inp.tokens, inp.positions, inp.meta, inp.logits_rows,
                         inp.streams, key, *scalars), kw

    def _run(self, flat_state, inp: PassInputs, key, sp, mode, live: bool = False):
        """Prefill (``PassInputs``) -> ``(tokens [S], logprobs [S])``; decode/verify
        (``VerifyInputs``) -> ``(tokens [T], logprobs [T], num_emitted [S])``, packed. With
        ``live`` (a rollout's pass) a decode/verify pass's time goes to the pass-cost model
        (``PassCost.observe``: live times replace profiled ones)."""
        fn, args, kw = self._call(flat_state, inp, key, sp, mode)
        chunked = isinstance(inp, (chunk.ChunkInputs, chunk_spec.SpecChunkInputs))
        shape = inp.pass_shape() if chunked else batching.shape_of(inp)
        self.programs_run.add(shape)
        t0 = time.perf_counter()
        *out, self.kv = fn(*args, **kw)
        t1 = time.perf_counter()
        out = jax.device_get(tuple(out))
        wait = time.perf_counter() - t1
        self.device_wait_seconds += wait
        if fn is prefill_pass:
            self.prefill_wait_seconds += wait
        if live:
            self._observe(shape, out, time.perf_counter() - t0)
        if self.check_invariants:
            self.allocator.check()
        return out

    def table_width(self, ids: np.ndarray) -> int:
        """Page-table width (a ``plan.widths`` bucket, pages) of a pass over live slots ``ids``."""
        return self.plan.width(int(self.allocator.num_held[ids].max()))

    def _observe(self, shape: shapes.PassShape, out: tuple, seconds: float) -> None:
        """A live call's seconds per pass to ``PassCost.observe`` at the call's table width: a
        decode/verify pass as timed; a chunk's time over its passes, under its passes' program
        (plain chunk: decode ``(S, S, 1)``; HistoSpec chunk: verify ``(S, T, Q)``, drafting included),
        and to the ``SpecGuard``'s realized seconds per pass of its kind."""
        if shape.kind in ("decode", "verify"):
            self.pass_cost.observe(shape.rows, shape.tokens, shape.q_len, seconds, width=shape.width)
        elif shape.kind in ("chunk", "spec_chunk"):
            ran = int(np.ravel(out[3])[0])  # plain chunk: passes run; HistoSpec chunk: its tally starts with them
            if ran > 0:
                self.pass_cost.observe(shape.rows, shape.tokens, shape.q_len, seconds / ran, width=shape.width)
                self.spec_guard.observe_seconds(shape.kind == "spec_chunk", shape.rows, shape.width, shape.tokens,
                                                seconds / ran)

    def _use_guard(self, drafter: Drafter | None) -> None:
        """Make ``self.spec_guard`` the guard of ``drafter``'s kind (its class; the first kind seen
        keeps the engine's first guard): acceptance and verify seconds belong to a drafter, so a
        paired unit's always-right oracle and the run's drafter on one engine do not judge each
        other's chunks; decode's seconds are the engine's, shared by all."""
        guard = self._guards.get(type(drafter))
        if guard is None:
            guard = self._guards[type(drafter)] = self.spec_guard if not self._guards else SpecGuard(
                plain_seconds=self.spec_guard.plain_seconds, enabled=self.spec_guard.enabled)
        self.spec_guard = guard

    def _draft(self, drafter: Drafter | None, table: SlotTable, ids: np.ndarray,
               backoff: allocation.DraftBackoff | None = None) -> tuple[np.ndarray, PassChoice]:
        """Drafts ``i32[n, K]`` of the live slots ``ids`` and the step that carries them
        (``allocation.PassChoice``: program and kept draft lengths; ``K = 0`` without a drafter).
        The engine alone sizes drafts: they never pass the request's ``max_new_tokens`` (room for
        the bonus token) nor ``shapes.MAX_DRAFT``; with the drafter's acceptance estimates the
        goodput allocation keeps what pays under ``self.pass_cost``, else they are cut
        longest-first to the step's token budget; they only use pages the pool can give without
        preempting anyone (a draft is cut to the pages its slot holds otherwise); a step where
        the drafter proposes nothing is the plain decode step (``allocation.fixed_rule``). With ``backoff``
        (goodput) the drafter is skipped while the choice keeps sending nothing
        (``allocation.DraftBackoff``)."""
        if (drafter is None or ids.size == 0
                or backoff is not None and backoff.skip(self.plan.bucket(ids.size))):
            return np.zeros((ids.size, 0), np.int32), allocation.fixed_rule(self.plan, np.zeros(ids.size, np.int64))
        t0 = time.perf_counter()
        reqs = table.req[ids]
        budgets = np.maximum(table.limit - table.n_generated[reqs] - 1, 0)
        d_tok, got = drafter.draft(reqs, table.tails.get(ids), budgets)
        est = getattr(drafter, "estimates", None)
        prio = getattr(drafter, "priorities", None)
        table.stats["drafting_seconds"] += time.perf_counter() - t0
        d_tok = np.asarray(d_tok, np.int32)
        got = np.minimum(np.minimum(np.minimum(got, budgets), shapes.MAX_DRAFT), d_tok.shape[1]).astype(np.int64)
        if not got.any():  # nothing proposed: the plain decode step, no choice to make
            return d_tok[:, :0], allocation.fixed_rule(self.plan, got)
        cost = functools.partial(self.pass_cost, width=self.table_width(ids))  # the programs' costs at this width
        choice, curve = allocation.choose_pass(self.plan, got, est, cost, prio)
        if backoff is not None and est is not None:
            backoff.chose(True, bool(choice.draft_lens.any()))  # proposed: got has a draft
        lens = self._page_cut(table, ids, choice.draft_lens)
        table.stats["predicted_accepted"] += allocation.expected_accepted(curve, lens)
        return d_tok, dataclasses.replace(choice, draft_lens=lens)

    def _page_cut(self, table: SlotTable, ids: np.ndarray, got: np.ndarray) -> np.ndarray:
        """Draft lengths ``got`` cut to the pages each slot holds after taking the pages the pool
        can give without preempting anyone (``int64[n]``, ``>= 0``)."""
        ps, alloc = self.page_size, self.allocator
        got = np.asarray(got, np.int64)
        lens = table.length[ids]
        need = alloc.pages_for(lens + 1 + got) - alloc.num_held[ids]
        for i in np.flatnonzero((got > 0) & (need > 0)):  # drafts crossing into pages not held yet
            if alloc.can_alloc(int(need[i])):
                alloc.ensure(int(ids[i]), int(lens[i]) + 1 + int(got[i]))
        # never below 0: a slot whose held pages are full (its pending token opens the next page,
        # which a chunk reserves only after drafting) sends no draft, not a negative one
        return np.maximum(np.minimum(got, alloc.num_held[ids].astype(np.int64) * ps - lens - 1), 0)

    def _pass_inputs(self, ids, drafts, choice: PassChoice, table: SlotTable) -> batching.VerifyInputs:
        """Pack one decode/verify step of live slots ``ids`` as ``choice`` sized it. Counts
        drafted tokens."""
        table.stats["drafted_tokens"] += int(choice.draft_lens.sum())
        return batching.verify_inputs(ids, table.length, table.pending, drafts, choice.draft_lens,
                                      self.allocator.page_table, self.page_size, choice.rows, choice.tokens,
                                      choice.q_len, self.table_width(ids), slot_streams=table.req)

    def _chunk(self, table: SlotTable, run: "_Passes", drafter: Drafter | None) -> bool:
        """One chunk of ``plan.passes`` passes in one dispatch: plain (``rollout/chunk.py``)
        without a drafter, with device drafts (``rollout/chunk_spec.py``) with one that gives
        ``history_rows``. False when the pool cannot hold it (the caller runs one pass)."""
        if drafter is None:
            return chunk.decode(self, table, run)
        if not hasattr(drafter, "history_rows"):
            return False
        return chunk_spec.decode(self, table, run, drafter)

    def _prefill(self, table: SlotTable, batch: list, run: "_Passes") -> None:
        """One packed prefill pass over the rows ``admit`` chose; records each row's first token."""
        total = sum(len(new) for _, new, _ in batch)
        slots = np.array([b[0] for b in batch], np.int64)
        inp = batching.prefill_inputs(batch, self.allocator.page_table, self.page_size, self.max_slots,
                                      *self.plan.prefill_shape(total), slot_streams=table.req,
                                      width=self.table_width(slots))
        toks, lps = run(inp)
        table.stats["prefill_steps"] += 1
        table.stats["sequence_steps"] += len(batch)
        table.stats["prefill_tokens"] += total
        filled = np.array([b[0] for b in batch], np.int64)
        table.record(filled, toks[: len(batch), None], lps[: len(batch), None], np.ones(len(batch), np.int64))

    def _decode(self, table: SlotTable, run: "_Passes", drafter: Drafter | None,
                backoff: allocation.DraftBackoff | None = None) -> None:
        """One decode/verify pass over the live slots: each feeds its pending token plus its draft;
        the emitted tokens (accepted drafts + one sampled) are recorded and the drafter told."""
        ids = table.live()
        drafts, choice = self._draft(drafter, table, ids, backoff)
        inp = self._pass_inputs(ids, drafts, choice, table)
        d_lens = inp.draft_lens[: ids.size]
        toks, lps, n_emit = run(inp)
        cu = inp.meta.cu_q_lens
        toks = batching.unpack_rows(toks, cu, ids.size, inp.max_q_len)
        lps = batching.unpack_rows(lps, cu, ids.size, inp.max_q_len)
        table.stats["decode_steps"] += 1
        table.stats["decode_dispatches"] += 1
        table.stats["sequence_steps"] += ids.size
        accepted = n_emit[: ids.size] - 1
        table.stats["accepted_tokens"] += int(accepted.sum())
        if drafter is not None:
            drafter.observe(table.req[ids], d_lens, accepted)
        # KV now holds the pending token and the accepted drafts; the last emitted token is the
        # new pending one (rejected draft positions are overwritten later).
        table.length[ids] += table.record(ids, toks[: ids.size], lps[: ids.size], n_emit[: ids.size])

    # ------------------------------------------------------------------ main loop
    def generate(self, state: nnx.State, prompts: list[list[int]], sampling: SamplingParams,
                 key: jax.Array, drafter: Drafter | None = None, *, prefixes: Sequence | None = None,
                 monitor: Callable[["Progress"], Sequence[int]] | None = None,
                 on_stop: Callable[[int, np.ndarray, np.ndarray], None] | None = None) -> RolloutResult:
        """Generate one response per prompt.

        Args:
          state: ``nnx.split(model)[1]`` matching the engine's graphdef.
          prompts: token id lists (1 <= len <= max_prompt_len unless skipping overlong ones).
          sampling: sampling settings; ``max_new_tokens`` <= the engine's.
          key: PRNG key; the token after position ``p`` of request ``r`` (its index in ``prompts``)
            is drawn with ``fold_in(fold_in(key, r), p)`` (``sampling.position_noise``),
            whichever pass samples it, so drafts change how many passes run, never the tokens.
          drafter: optional ``types.Drafter`` (HistoSpec: ``rhyme_jax.spec.drafter.Drafter.batch``
            of these prompts): each decode step asks it for drafts of the active requests
            (``draft(reqs, tails, budgets)``, tails of ``context_width`` tokens) and reports
            acceptance (``observe``). The emitted tokens have exactly the distribution of plain
            decoding.
          prefixes: optional per request ``(tokens int32[m], logprobs f32[m])`` of a response
            already begun elsewhere (a migrated sequence): the request is prefilled with prompt +
            those tokens and continues from there; they count toward ``max_new_tokens`` and are
            returned at the head of its response. ``m = 0`` = a fresh request.
          monitor: optional callback after every decode step (every chunk of steps with
            ``passes_per_dispatch > 1``) with a ``Progress``; it returns the
            request indices to stop now (their slots are freed; finish reason ``"migrated"``,
            partial response returned). HistoPipe's tail migration (``sched/migration.py``).
          on_stop: called at once for each request the monitor stops, with its partial response
            ``(request, tokens int32[m], logprobs f32[m])``, so it can continue elsewhere while
            this call is still decoding the others.

        Returns:
          RolloutResult in prompt order.

        Raises:
          PromptTooLongError: a prompt is longer than ``max_prompt_len`` in "error" mode.
          EngineConfigError: empty prompt, token id outside the vocabulary, bad sampling params,
            bad prefixes.
        """
        t0, wait0, prefill0 = time.perf_counter(), self.device_wait_seconds, self.prefill_wait_seconds
        reqs = self._validate(prompts, sampling)
        self._ensure_pool(state)
        if getattr(drafter, "idle", False):  # nothing to draft from: plain decoding, no drafter calls
            drafter = None
        self._use_guard(drafter)
        run = _Passes(self, self._flat_state(state), key, sampling)
        backoff = allocation.DraftBackoff()
        table = SlotTable(reqs, self.allocator, limit=sampling.max_new_tokens, eos_ids=self.eos_ids,
                          vocab_size=self.model_cfg.vocab_size, share_prompt_prefix=self.share_prompt_prefix,
                          context_width=0 if drafter is None else int(drafter.context_width), prefixes=prefixes)
        while table.waiting or table.any_live():
            while table.waiting and table.has_free():  # admission: packed prefills until full
                batch = table.admit(self.prefill_budget)
                if not batch:
                    break
                self._prefill(table, batch, run)
            if not table.any_live():
                continue
            if not (self.plan.passes > 1 and self._chunk(table, run, drafter)):
                table.grow_pages()  # may preempt the newest sequences
                if not table.any_live():
                    continue
                self._decode(table, run, drafter, backoff)
            if monitor is not None:
                table.stop(monitor(table.progress()), on_stop)
        table.stats["device_wait_seconds"] = self.device_wait_seconds - wait0
        table.stats["prefill_wait_seconds"] = self.prefill_wait_seconds - prefill0
        return table.result(time.perf_counter() - t0)


class _Passes:
    """The forward passes of one ``generate`` call: runs a step's inputs with the call's model
    leaves, key and sampling program (every token's draw keyed by its request and position)."""

    def __init__(self, engine: RolloutEngine, flat_state, key: jax.Array, sampling: SamplingParams):
        self.engine, self.flat_state, self.key, self.sampling = engine, flat_state, key, sampling
        self.mode = sampling.mode

    def __call__(self, inp: PassInputs):
        """``RolloutEngine._run`` of ``inp`` as the next live pass."""
        return self.engine._run(self.flat_state, inp, self.key, self.sampling, self.mode, live=True)
