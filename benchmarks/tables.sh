#!/usr/bin/env bash
# Every CPU table of docs/results.md and docs/reproduction.md again, at one commit, one after
# another (nothing else should run on the machine meanwhile: the timings are wall clock).
#
#   . .venv/bin/activate && bash benchmarks/tables.sh [OUT]        # OUT default results/tables
#
# About 2.5 hours on 2 CPU cores with warm caches (SmolLM2 imported, compile cache): the learning
# suite L1, L3, L4 with the demo's SFT warm start (~35 min) and L2 quick (~55 min), the paper's
# ablations quick (~7 min), the rollout program and memory reports, prefill, the rollout
# benchmarks on the demo model (goodput, both oracles) and on SmolLM2, the row sweep and the
# near-greedy repeat. Each step logs to OUT/bench/NAME.log under /usr/bin/time -v (wall, peak
# RSS); OUT/bench/progress lists the steps with their start, end and exit status, and its first
# line the commit (the ablation units stamp theirs: rhyme_lab/provenance.py). A failed step
# does not stop the others. STEPS="a b" runs only the named steps (names as in the progress file).
set -u
cd "$(dirname "$0")/.."
OUT=${1:-results/tables}
B=$OUT/bench
mkdir -p "$B"
OLD_DEMO="--set grpo.steps=60 --set grpo.num_prompts=160 --set grpo.learning_rate=2e-4 --set grpo.minibatches=1"
NEAR_GREEDY="--steps 12 --set rollout.temperature=0.05 --set grpo.learning_rate=1e-9 --set grpo.num_prompts=64
  --set grpo.minibatches=1 --set rollout.max_verify_tokens=4224"
SFT=$OUT/learning/runs/demo_sft/sft  # the rollout benchmarks start from the learning suite's SFT warm start
BENCH_RUNS="--set run.runs_dir=$OUT/runs"  # each rollout benchmark its own run directory under OUT
echo "commit $(python -c 'from rhyme_lab.provenance import stamp; print(stamp())')" >> "$B/progress"

TIMER=(/usr/bin/time -v)  # wall and peak RSS in each log; without GNU time the steps run untimed
[ -x /usr/bin/time ] || TIMER=()

step() {
  local name=$1
  shift
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
  echo "$(date +%T) start $name" >> "$B/progress"
  "${TIMER[@]}" "$@" > "$B/$name.log" 2>&1
  echo "$(date +%T) done $name rc=$?" >> "$B/progress"
}

step learning_L1 python -m rhyme_lab ablate learning --only L1,L3,L4 --out "$OUT/learning" --no-progress
step learning_L2 python -m rhyme_lab ablate learning --quick --only L2 --out "$OUT/learning-quick" --no-progress
step paper_quick python -m rhyme_lab ablate paper --quick --out "$OUT/paper-quick" --no-progress
step compile_demo rhyme-jax compile-report --config configs/default.yaml --sample 0
step compile_smol rhyme-jax compile-report --config configs/gsm8k_smollm2_135m.yaml --sample 0
step compile_qwen rhyme-jax compile-report --config configs/gsm8k_qwen2.5_1.5b.yaml \
  --model-config configs/models/qwen2.5-1.5b --sample 0
step compile_qwen_sample3 rhyme-jax compile-report --config configs/gsm8k_qwen2.5_1.5b.yaml \
  --model-config configs/models/qwen2.5-1.5b --sample 3
step memory_qwen rhyme-jax memory --config configs/gsm8k_qwen2.5_1.5b.yaml --model-config configs/models/qwen2.5-1.5b \
  --devices 8 --set parallel.fsdp=8 --rows 8 --tokens 1536 --json
step memory_smol rhyme-jax memory --config configs/gsm8k_smollm2_135m.yaml --rows 32 --tokens 512 --json
step memory_smol_nosave rhyme-jax memory --config configs/gsm8k_smollm2_135m.yaml --rows 32 --tokens 512 --json \
  --set grpo.logit_chunk=0 --set grpo.remat=false
step prefill_demo python -m benchmarks.prefill
step prefill_smol python -m benchmarks.prefill --config configs/gsm8k_smollm2_135m.yaml --tokens 512 --repeats 3
# shellcheck disable=SC2086  # the option strings split into words on purpose
step rollout_demo python -m benchmarks.rollout --init-from "$SFT" --steps 24 $OLD_DEMO $BENCH_RUNS --name goodput
# shellcheck disable=SC2086
step rollout_demo_oracle_sources python -m benchmarks.rollout --init-from "$SFT" --steps 24 $OLD_DEMO --oracle sources $BENCH_RUNS --name oracle_sources
# shellcheck disable=SC2086
step rollout_demo_oracle python -m benchmarks.rollout --init-from "$SFT" --steps 24 $OLD_DEMO --oracle $BENCH_RUNS --name oracle_always_right
step rollout_real python -m benchmarks.rollout_real --prompts 4 --samples 4 --max-slots 16 --max-new-tokens 128 \
  --temperatures 1.0,0.6,0.3 --goodput --repeats 3
step spec_sweep python -m benchmarks.spec_sweep --init-from "$SFT" --steps 4 --set grpo.minibatches=1
# shellcheck disable=SC2086
step near_greedy python -m benchmarks.rollout --init-from "$SFT" $NEAR_GREEDY $BENCH_RUNS --name near_greedy
# shellcheck disable=SC2086
step near_greedy_oracle python -m benchmarks.rollout --init-from "$SFT" $NEAR_GREEDY --oracle $BENCH_RUNS --name near_greedy_always_right
echo "$(date +%T) all done" >> "$B/progress"
