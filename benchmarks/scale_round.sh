#!/usr/bin/env bash
# One device call of the multi-GPU scaling work (issue 22) on `nvidia-h200-x2`: bench-moe with
# the global batch scaled with the GPU count (4 rows of 4096 tokens per GPU), default trainer
# (float32 masters). Steps by name (STEPS="ep2 one ..."), each under its own limit, logs packed
# into $OUT/logs.tgz after every step; a summary prints last.
#
#   OUT=/tmp/out STEPS="topo ep2 one ep2none fsdp2" bash benchmarks/scale_round.sh
set -u
OUT=${OUT:-/tmp/scale_out}
LOGS=${LOGS:-/tmp/scale_logs}
BUDGET=${BUDGET:-100000}  # seconds: a step starts only while the run is younger than this
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.97}
TS="python3 benchmarks/train_step.py --config bench-moe --steps ${NSTEPS:-5} --warmup 2"
run() {  # run NAME LIMIT_S CMD...
  local name=$1 limit=$2
  shift 2
  if ((SECONDS > BUDGET)); then
    echo "=== $name: skipped (run older than BUDGET=$BUDGET s)" | tee -a "$OUT/summary.txt"
    return 1
  fi
  echo "=== $name: $*" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS rc
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  echo "rc=$rc ${name} $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  grep -E "^\| osworld|^step [0-9]|^devices|^batch|^first step|^step time|^final loss|^peak memory|Error|error:" \
    "$LOGS/$name.log" | tail -12 >>"$OUT/summary.txt"
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
  return $rc
}
for step in ${STEPS:-topo ep2 one}; do
  case $step in
  topo) run topo 60 bash -c "nvidia-smi topo -m; nvidia-smi --query-gpu=name,memory.total \
      --format=csv; python3 -c 'import jax; print(jax.__version__, jax.devices())'" ;;
  ep2)  # the 2-GPU preset: expert=2, overlap flags; on a failure the same without the flags
    run ep2 170 $TS --mesh 1,1,2,1 --batch 8 --overlap pipelined ||
      run ep2-noflags 170 $TS --mesh 1,1,2,1 --batch 8 ;;
  ep2none) run ep2none 170 $TS --mesh 1,1,2,1 --batch 8 ;;  # no overlap flags
  ep2mosaic) run ep2mosaic 170 $TS --mesh 1,1,2,1 --batch 8 \
      --expert-backend pallas_gmm_mosaic ;;  # Mosaic kernels: the worst-case rows computed
  one) run one 170 env CUDA_VISIBLE_DEVICES=0 $TS ;;  # 1 GPU of the same machine, B=4
  fsdp2)  # the previous 2-GPU layout: experts FSDP-gathered, B=8
    run fsdp2 170 $TS --mesh 1,2,1,1 --batch 8 --no-expert-parallel ;;
  # The same batch (B=4: the 1-GPU rows) on 1 and 2 GPUs, every step's loss and grad norm:
  one4) run one4 120 env CUDA_VISIBLE_DEVICES=0 $TS --print-steps ;;
  ep2b4) run ep2b4 120 $TS --mesh 1,1,2,1 --print-steps ;;
  ep2b4p) run ep2b4p 120 $TS --mesh 1,1,2,1 --print-steps --overlap pipelined ;;
  fsdp2b4) run fsdp2b4 120 $TS --mesh 1,2,1,1 --print-steps --no-expert-parallel ;;
  # B=8 on 1 GPU needs bf16 masters to fit: the same batch on 1 GPU, 2 GPUs, 2 GPUs + flags
  one8bf) run one8bf 120 env CUDA_VISIBLE_DEVICES=0 $TS --batch 8 --master-dtype bfloat16 \
      --print-steps ;;
  ep2b8bf) run ep2b8bf 120 $TS --mesh 1,1,2,1 --batch 8 --master-dtype bfloat16 --print-steps ;;
  ep2b8bfp) run ep2b8bfp 120 $TS --mesh 1,1,2,1 --batch 8 --master-dtype bfloat16 \
      --print-steps --overlap pipelined ;;
  ep2b8p) run ep2b8p 120 $TS --mesh 1,1,2,1 --batch 8 --print-steps --overlap pipelined ;;
  ep2b8) run ep2b8 120 $TS --mesh 1,1,2,1 --batch 8 --print-steps ;;
  prof1)  # one profiled step (after 2 timed) on 1 GPU, B=4; kernel time by kind printed
    run prof1 120 env CUDA_VISIBLE_DEVICES=0 $TS --steps 2 --warmup 1 --profile /tmp/prof1
    python3 benchmarks/trace_kernels.py /tmp/prof1 --top 12 | tee -a "$OUT/summary.txt"
    tar czf "$OUT/prof1.tgz" -C /tmp/prof1 . ;;
  prof2)  # the same on 2 GPUs, expert=2, B=8
    run prof2 120 $TS --steps 2 --warmup 1 --mesh 1,1,2,1 --batch 8 --profile /tmp/prof2
    python3 benchmarks/trace_kernels.py /tmp/prof2 --top 12 | tee -a "$OUT/summary.txt"
    tar czf "$OUT/prof2.tgz" -C /tmp/prof2 . ;;
  *) echo "unknown step $step" ;;
  esac
done
echo
cat "$OUT/summary.txt"
