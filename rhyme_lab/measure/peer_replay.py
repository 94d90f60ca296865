"""The suffix-tree peer in the drafter replay: ArcticInference's SuffixDecoding along target texts.

The library of ``python -m benchmarks.replay_peer``.

Same input and accounting as ``python -m rhyme_lab replay-drafts`` (``rhyme_lab/measure/text_replay.py``; the JSONL is
parsed and tokenized by its ``read_cases``): along each target, every pass drafts, the longest
draft prefix equal to the target's next tokens is accepted, and the pass emits the accepted tokens
plus one. Pooled over all targets it prints ``predicted_share`` (accepted / target tokens),
``tokens_per_forward`` (emitted per sequence pass), ``drafted_per_forward`` and ``acceptance``
(accepted / drafted); ``--json`` prints one object.

The drafter is SuffixDecoding (Oliaro et al., arXiv 2411.04975), the C++ suffix tree of
arctic-inference 0.3.0 (``csrc/suffix_decoding``, built by ``benchmarks/build_suffix_peer.sh`` into
``benchmarks/.peer_build/``), used as vLLM's ``suffix`` method uses it through the package's cache
(vLLM ``SuffixDecodingProposer`` + arctic-inference ``SuffixDecodingCache``):

* the global tree holds previous responses: here the line's ``history`` responses (the same
  information ``replay-drafts`` gives our drafter: each line is its own prompt), plus the running
  target's own tokens (vLLM appends an active request's response to the global tree as it grows);
* the per-request tree holds the prompt and the target's tokens so far (self-lookup);
* each pass: the context is the last ``max_tree_depth`` tokens of prompt + target so far; both
  trees ``speculate`` (every match length from 1 up, draft length at most ``max_spec_factor`` x
  match length + ``max_spec_offset`` and ``max_spec_tokens``, tokens while the path probability
  from branch counts stays >= ``min_token_prob``) and the draft with the higher score (sum of
  probabilities; the request tree wins ties) is sent, cut to the target tokens left - 1.

Defaults are vLLM's for ``method="suffix"``: ``suffix_decoding_max_tree_depth=24``,
``suffix_decoding_max_spec_factor=1.0``, ``suffix_decoding_min_token_prob=0.1``,
``num_speculative_tokens`` unset -> the tree depth (24), ``max_spec_offset=0``, path (not tree)
drafts. Differences from ``replay-drafts``: the peer has no step shape, so its drafts are neither
batched nor cut to a step's packed-token budget or ``max_q_len`` (``--rows`` does not apply), and
targets never see each other (a finished target is not cached for the next, as in ours).

    bash benchmarks/build_suffix_peer.sh
    python -m benchmarks.replay_peer /tmp/corpora/smollm2.jsonl \
        --tokenizer ~/.cache/rhyme_jax/models/smollm2-135m-instruct --json
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rhyme_lab.measure.text_replay import ReplayCase


@dataclass(frozen=True)
class PeerOptions:
    """The peer's drafting settings; defaults are vLLM's for ``method="suffix"`` (module docstring).

    Attributes:
      max_tree_depth: the suffix trees' depth and the context (tokens); max_spec_tokens: draft
      tokens per pass at most (vLLM: the tree depth); max_spec_factor / max_spec_offset: draft <=
      factor x match length + offset; min_token_prob: the path-probability floor; tree_spec: tree
      drafts, accepted along the matching branch.
    """

    max_tree_depth: int = 24
    max_spec_tokens: int = 24
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    tree_spec: bool = False


class PeerUnavailable(RuntimeError):
    """The peer's extension is not built (message says how to build it)."""


def load_peer(build_dir: Path):
    """The compiled ``_C`` extension module of arctic-inference's suffix decoding in
    ``build_dir`` (``_C*.so`` / ``_C*.pyd``, loaded by file, ``sys.path`` untouched).

    Raises:
      PeerUnavailable: no loadable ``_C`` in ``build_dir`` (the message says how to build it).
    """
    import importlib.machinery
    import importlib.util

    found = sorted(p for suffix in importlib.machinery.EXTENSION_SUFFIXES for p in Path(build_dir).glob(f"_C{suffix}"))
    why = "no _C extension"
    for path in found:
        try:
            spec = importlib.util.spec_from_file_location("_C", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
        except ImportError as exc:
            why = str(exc)
    raise PeerUnavailable(f"no suffix-tree peer in {build_dir} ({why}); "
                          "build it with: bash benchmarks/build_suffix_peer.sh")


def _accepted(draft, target: np.ndarray) -> int:
    """Longest prefix of ``target`` the draft predicts: along the path for a path draft, along the
    matching branch for a tree draft (``parents[i]`` = index of token i's parent, -1 = root)."""
    tokens, parents = list(draft.token_ids), list(draft.parents)
    node, n = -1, 0
    while n < target.size:
        nxt = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == target[n]), None)
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


def _cut(draft, limit: int):
    """Keep the tokens of ``draft`` within ``limit`` tokens of depth (a path: its first ``limit``)."""
    if len(draft.token_ids) <= limit:
        return draft
    depth, keep = {}, []
    for i, p in enumerate(draft.parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
        if depth[i] <= limit:
            keep.append(i)
    where = {old: new for new, old in enumerate(keep)}
    draft.token_ids = [draft.token_ids[i] for i in keep]
    draft.parents = [where.get(draft.parents[i], -1) for i in keep]
    return draft


def replay_case(peer, case: ReplayCase, opts: PeerOptions, totals: dict) -> None:
    """Draft along one target with the peer (see the module docstring); adds to ``totals``
    (``passes``, ``drafted``, ``accepted``, ``draft_seconds``)."""
    depth = opts.max_tree_depth
    glob, local = peer.SuffixTree(depth), peer.SuffixTree(depth)
    for seq, response in enumerate(case.history):
        glob.extend_ndarray(seq, np.ascontiguousarray(response, np.int32))
    own = len(case.history)  # the running target's sequence in the global tree
    local.extend_ndarray(0, np.ascontiguousarray(case.prompt, np.int32))
    seq = np.concatenate([case.prompt, case.target]).astype(np.int32)
    start, size, done = case.prompt.size, case.target.size, 0
    while done < size:
        context = np.ascontiguousarray(seq[max(0, start + done - depth): start + done])
        limit = min(opts.max_spec_tokens, size - done - 1)
        t0 = time.perf_counter()
        drafts = [tree.speculate_ndarray(context, limit, opts.max_spec_factor, opts.max_spec_offset,
                                         opts.min_token_prob, opts.tree_spec) for tree in (local, glob)]
        draft = _cut(drafts[0] if drafts[0].score >= drafts[1].score else drafts[1], limit)
        totals["draft_seconds"] += time.perf_counter() - t0
        accepted = _accepted(draft, case.target[done:])
        emitted = np.ascontiguousarray(case.target[done: done + accepted + 1], np.int32)
        local.extend_ndarray(0, emitted)
        glob.extend_ndarray(own, emitted)
        done += emitted.size
        totals["passes"] += 1
        totals["drafted"] += len(draft.token_ids)
        totals["accepted"] += accepted


def replay(peer, cases: list[ReplayCase], opts: PeerOptions) -> dict[str, float]:
    """Replay every case (independently). Returns the figures ``python -m rhyme_lab replay-drafts`` returns
    (``predicted_share``, ``tokens_per_forward``, ``drafted_per_forward``, ``acceptance``,
    ``target_tokens``, ``sequence_passes``, ``drafted_tokens``, ``accepted_tokens``) plus
    ``draft_ms_per_pass`` (host time of the two ``speculate`` calls, milliseconds)."""
    totals = dict(passes=0, drafted=0, accepted=0, draft_seconds=0.0)
    for case in cases:
        replay_case(peer, case, opts, totals)
    tokens = sum(c.target.size for c in cases)
    return {"predicted_share": totals["accepted"] / tokens,
            "tokens_per_forward": tokens / totals["passes"],
            "drafted_per_forward": totals["drafted"] / totals["passes"],
            "acceptance": totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0,
            "target_tokens": tokens, "sequence_passes": totals["passes"],
            "drafted_tokens": totals["drafted"], "accepted_tokens": totals["accepted"],
            "draft_ms_per_pass": 1e3 * totals["draft_seconds"] / totals["passes"]}
