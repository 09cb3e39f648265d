#!/usr/bin/env bash
# One device call of the H200 throughput work (issue 19): kernels, train-step variants, memory,
# one profiled step with its optimized HLO. Steps are chosen by name (STEPS="gemm step ...");
# each runs under its own time limit and logs to $LOGS/<step>.log, packed into $OUT/logs.tgz after
# every step (a call brings back at most 8 files); a summary prints last.
#
#   OUT=/tmp/out STEPS="gemm step f32" bash benchmarks/h200_round.sh
set -u
OUT=${OUT:-/tmp/h200_out}
LOGS=${LOGS:-/tmp/h200_logs}  # packed into $OUT/logs.tgz after every step
BUDGET=${BUDGET:-100000}  # seconds: a step starts only while the run is younger than this
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.97}
TS="${PY:-python3} benchmarks/train_step.py --config ${CONFIG:-bench-moe} --steps ${NSTEPS:-5} --warmup 2"
run() {  # run NAME LIMIT_S CMD...
  local name=$1 limit=$2
  shift 2
  if ((SECONDS > BUDGET)); then
    echo "=== $name: skipped (run older than BUDGET=$BUDGET s)" | tee -a "$OUT/summary.txt"
    return
  fi
  echo "=== $name: $*" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  echo "rc=$? ${name} $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  grep -E "^\| (osworld|HF|experts|check|softmax|ours.gmm|dense)|^MEMORY|failed|Error|error" \
    "$LOGS/$name.log" | tail -12 >>"$OUT/summary.txt"
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
}
for step in ${STEPS:-gemm step}; do
  case $step in
  gemm)  # kernels: the shipped default, its parts, the Triton/Mosaic alternatives
    run gemm 240 python3 benchmarks/moe_gemm.py --quick --skip-slow --json "$LOGS/moe_gemm.json" \
      --only "dense,copy,ragged,ours.triton a128 mm128x256x64w8s3,ours.mosaic 128x256x64s3M4,ours.gmm" ;;
  gemmq)  # the shipped default only (checked against lax.ragged_dot), with the two ceilings
    run gemmq 120 python3 benchmarks/moe_gemm.py --quick --skip-slow --only "dense,copy,ragged,ours.gmm" ;;
  parts)  # expert layers under a scan (composed / twin variants, checks) + logprob softmax passes
    run parts 150 python3 benchmarks/train_parts.py --part all ;;
  peers)  # HF transformers peers (PEERS: eager,compile by default; ours skipped)
    run peers 300 $TS --hf-peers "${PEERS:-eager,compile}" --no-ours \
      ${PEER_TIMEOUT:+--peer-timeout $PEER_TIMEOUT} ;;
  prof)  # bf16 params + moments, profiled step + optimized HLO of the train step
    export XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*"
    run prof 200 $TS --master-dtype bfloat16 --profile /tmp/prof
    unset XLA_FLAGS
    tar czf "$OUT/prof.tgz" -C /tmp/prof . 2>/dev/null
    (cd /tmp/hlo 2>/dev/null && tar czf "$OUT/hlo.tgz" $(ls | grep -E "after_optimizations(.txt|-memory)")) ;;
  step) run step 150 $TS --master-dtype bfloat16 ;;
  dsf)  # XLA's dynamic-slice fusion (slices of the stacked weights passed to the kernels in place)
    export XLA_FLAGS="--xla_gpu_enable_dynamic_slice_fusion=true"
    run dsf 150 $TS --master-dtype bfloat16
    unset XLA_FLAGS ;;
  nodsf)  # XLA's dynamic-slice fusion off (on by default in jax 0.11.2's XLA)
    export XLA_FLAGS="--xla_gpu_enable_dynamic_slice_fusion=false"
    run nodsf 150 $TS --master-dtype bfloat16
    unset XLA_FLAGS ;;
  recompute) run recompute 150 $TS --master-dtype bfloat16 --save-probs-bytes 0 ;;
  unroll) run unroll 200 $TS --master-dtype bfloat16 --unroll ;;
  f32) run f32 180 $TS ;;  # the default trainer config: float32 masters
  f32dots) run f32dots 180 $TS --remat dots ;;
  dots) run dots 200 $TS --master-dtype bfloat16 --remat dots ;;  # bf16 states, remat dots
  mem*)  # memory-only compiles: mem-<remat>-<master>[-issue] (issue: 64 rows x 320, 8 micro)
    IFS=- read -r _ remat master extra <<<"$step"
    shape=""
    [ "${extra:-}" = issue ] && shape="--batch 64 --seq 320 --micro-batches 8"
    run "$step" 150 $TS --memory-only --remat "$remat" --master-dtype "$master" $shape ;;
  *) echo "unknown step $step" ;;
  esac
done
echo
cat "$OUT/summary.txt"
