#!/usr/bin/env bash
# The RL loop on one GPU (configs/gpu_1x_h100.gin, or GIN=...) from an offline bundle
# (scripts/offline_bundle.sh, copied to $BUNDLE): env probe, one jailed desktop, then train.py with
# max_staleness=$K; logs, metrics, GPU utilisation and memory samples in $OUT (copied as it runs).
#   OUT=/tmp/out K=1 STEPS=10 BUNDLE=/path/bundle bash benchmarks/gpu_loop.sh
# BASE=DIR reuses a base checkpoint made by an earlier run (ModelSourceConfig.path); EXTRA holds
# further --gin_param flags.
set -u
export PYTHONUNBUFFERED=1
GIN=${GIN:-configs/gpu_1x_h100.gin}
L=$OUT/k$K; mkdir -p $L   # this run's logs (tarred into $OUT/k$K.tgz at the end: 8 files come back)
[ -d /tmp/bundle/root ] || { cp -r "${BUNDLE:-.gpu/bundle}" /tmp/bundle && chmod 755 /tmp/bundle && bash scripts/offline_install.sh /tmp/bundle > $L/setup.log 2>&1; }
export PYTHONPATH=/tmp/bundle/site:$PWD
{ head -2 /etc/os-release; unshare -Ur true && echo "userns: ok"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; } >> $L/setup.log 2>&1
[ -f /tmp/jail_ok ] || { timeout 60 python3 benchmarks/jail_smoke.py /tmp/bundle/root >> $L/setup.log 2>&1 && touch /tmp/jail_ok; echo "jail rc=$?"; }
mkdir -p /tmp/rl; rm -rf /tmp/rl/k$K
base=()
[ -n "${BASE:-}" ] && [ -f "$BASE/config.json" ] && base=(--gin_param="ModelSourceConfig.path = '$BASE'")
# GPU utilisation and memory every 5 s (the mean of the samples goes into NOTES)
( while sleep 5; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits; done > $L/gpu.csv ) &
sampler=$!
t0=$SECONDS
timeout -s KILL ${LOOP_S:-540} python3 scripts/train.py --run_dir=/tmp/rl/k$K --steps=${STEPS:-10} \
  --gin_file=$GIN --gin_param="RLConfig.max_staleness = $K" \
  --gin_param="RLConfig.progress_bar = False" \
  --gin_param="LocalBackendConfig.system_root = '/tmp/bundle/root'" \
  --gin_param="LocalBackendConfig.window_manager = 'blackbox'" \
  "${base[@]}" ${EXTRA:-} > $L/train.log 2>&1 &
train=$!
# copy the run's logs to $OUT while it runs (a killed call still brings them back)
while kill -0 $train 2>/dev/null; do
  sleep 10; cp /tmp/rl/k$K/metrics.jsonl $L/metrics.jsonl 2>/dev/null; cp /tmp/rl/k$K/server.log $L/server.log 2>/dev/null; cp /tmp/rl/k$K/memory_plan.txt $L/memory_plan.txt 2>/dev/null
done
wait $train; rc=$?
kill $sampler 2>/dev/null
echo "rc=$rc $((SECONDS-t0)) s"; grep -vE "^\s*$" $L/train.log | tail -12
cp /tmp/rl/k$K/metrics.jsonl $L/metrics.jsonl 2>/dev/null; cp /tmp/rl/k$K/server.log $L/server.log 2>/dev/null
awk -F', ' '{u+=$1; if ($2>m) m=$2; n++} END {if (n) printf "gpu utilisation mean %.1f%% over %d samples, peak memory.used %d MiB\n", u/n, n, m}' $L/gpu.csv
python3 - "$L/metrics.jsonl" <<'PY' 2>&1 | tail -14
import json, sys
keys = ("time/step", "time/rollout", "time/train", "time/refit", "time/checkpoint", "memory/peak_gib", "steps/skipped",
        "time/owner_generate", "rollout/cache_hit_rate",
        "compile/programs", "compile/cache_hits", "compile/seconds", "compile/trace_lower_seconds")
print("step " + " ".join(k.replace("compile/", "c_").split("/")[-1] for k in keys))
for line in open(sys.argv[1]):
    d = json.loads(line)
    print(d.get("step"), " ".join(f"{d.get(k, float('nan')):.2f}" for k in keys))
PY
python3 benchmarks/rl_loop.py --staleness $K --keep /tmp/rl --tabulate 2>&1 | tail -8
df -h / | tail -1
rm -rf /tmp/rl/k$K/checkpoints /tmp/rl/k$K/weights
tar czf $OUT/k$K.tgz -C $OUT k$K && rm -rf $L
