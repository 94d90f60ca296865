"""The suffix-tree peer in the drafter replay: ArcticInference's SuffixDecoding along target texts.

Same input and accounting as ``python -m rhyme_lab replay-drafts``; the replay is
``rhyme_lab.measure.peer_replay`` (its docstring: how the peer drafts, vLLM's defaults, the
differences from ``replay-drafts``). Pooled over all targets it prints ``predicted_share``,
``tokens_per_forward``, ``drafted_per_forward``, ``acceptance`` and the host drafting time per
pass; ``--json`` prints one object.

    bash benchmarks/build_suffix_peer.sh
    python -m benchmarks.replay_peer /tmp/corpora/smollm2.jsonl \
        --tokenizer ~/.cache/rhyme_jax/models/smollm2-135m-instruct --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rhyme_lab.measure.peer_replay import PeerOptions, PeerUnavailable, load_peer, replay
from rhyme_lab.measure.text_replay import ReplayInputError, read_cases
from rhyme_jax.model.tokenizer import Tokenizer, TokenizerError

BUILD_DIR = Path(__file__).resolve().parent / ".peer_build"


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (peer defaults: vLLM's ``suffix`` method)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file", help="JSONL: {prompt, history: [str], history_rewards: [float], target} per line")
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json or a directory holding one")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--max-tree-depth", type=int, default=24, help="suffix trees' depth and context (vLLM: 24)")
    ap.add_argument("--max-spec-tokens", type=int, default=None,
                    help="draft tokens per pass at most (vLLM: num_speculative_tokens, default the tree depth)")
    ap.add_argument("--max-spec-factor", type=float, default=1.0, help="draft <= factor x match length (vLLM: 1.0)")
    ap.add_argument("--max-spec-offset", type=float, default=0.0, help="... + offset (vLLM: 0)")
    ap.add_argument("--min-token-prob", type=float, default=0.1, help="path probability floor (vLLM: 0.1)")
    ap.add_argument("--tree-spec", action="store_true", help="tree drafts, accepted along the matching branch")
    ap.add_argument("--build-dir", type=Path, default=BUILD_DIR, help="where the peer's _C is (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.max_spec_tokens is None:
        args.max_spec_tokens = args.max_tree_depth
    if args.max_tree_depth < 1 or args.max_spec_tokens < 0:
        ap.error("--max-tree-depth must be >= 1 and --max-spec-tokens >= 0")
    return args


def options(args: argparse.Namespace) -> PeerOptions:
    """The peer settings of the parsed command line."""
    return PeerOptions(args.max_tree_depth, args.max_spec_tokens, args.max_spec_factor, args.max_spec_offset,
                       args.min_token_prob, args.tree_spec)


def main(argv=None) -> int:
    """Run the replay; returns the exit status."""
    args = parse_args(argv)
    try:
        peer = load_peer(args.build_dir)
        tok = Tokenizer.from_file(args.tokenizer)
        cases = read_cases(Path(args.file), tok.encode)
    except (PeerUnavailable, TokenizerError, ReplayInputError) as exc:
        print(f"benchmarks.replay_peer: {exc}", file=sys.stderr)
        return 2
    out = replay(peer, cases, options(args))
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{len(cases)} targets, {out['target_tokens']} tokens, suffix-tree peer: predicted share "
              f"{out['predicted_share']:.3f}, {out['tokens_per_forward']:.2f} tokens and "
              f"{out['drafted_per_forward']:.2f} drafts per forward, acceptance {out['acceptance']:.3f}, "
              f"{out['draft_ms_per_pass']:.3f} ms drafting per pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
