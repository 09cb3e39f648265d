#!/usr/bin/env bash
# One device call of the bench-vl work (issue 31): the ViT's attention checks and timings, the
# bench-vl train step (ours, HF peers), bench-moe. Steps by name, each under its own limit,
# logs in $OUT/<step>.log; a summary prints last (benchmarks/NOTES.md quotes it).
#
#   OUT=/tmp/out STEPS="tower vl:none:none peers" bash benchmarks/vl_round.sh
#
# vl:<remat>:<vision_remat>[:prof] runs ours on bench-vl (prof: one profiled step, $OUT/prof.tgz).
set -u
OUT=${OUT:-/tmp/vl_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.97}
TS="python3 benchmarks/train_step.py --steps ${NSTEPS:-3} --warmup 2 --master-dtype bfloat16"
run() {  # run NAME LIMIT_S CMD...
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "rc=$? $name $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  grep -E "^\| (osworld|HF)|^CHECK|^TOWER|^estimate|^peak|^step time|rror" "$OUT/$name.log" \
    | grep -v Warning | tail -8 | tee -a "$OUT/summary.txt"
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee -a "$OUT/summary.txt"
for step in ${STEPS:-tower}; do
  case $step in
  tower) run tower "${TOWER_S:-200}" python3 benchmarks/vision_attention.py \
    --remat "${TOWER_REMAT:-none,full}" --steps 3 ;;
  vl:*)
    IFS=: read -r _ remat vremat prof <<<"$step"
    extra=""
    [ "${prof:-}" = prof ] && extra="--profile /tmp/prof"
    run "vl-$remat-$vremat" "${VL_S:-220}" $TS --config bench-vl --remat "$remat" \
      --vision-remat "$vremat" $extra
    [ -d /tmp/prof ] && tar czf "$OUT/prof.tgz" -C /tmp/prof . && rm -rf /tmp/prof ;;
  peers) run peers "${PEERS_S:-420}" $TS --config bench-vl --hf-peers "${PEERS:-eager,compile}" \
    --no-ours --peer-timeout "${PEER_TIMEOUT:-240}" ;;
  moe) run moe "${MOE_S:-300}" $TS --config bench-moe --hf-peers compile \
    --peer-timeout "${MOE_PEER_TIMEOUT:-200}" ;;
  *) echo "unknown step $step" ;;
  esac
done
echo
cat "$OUT/summary.txt"
