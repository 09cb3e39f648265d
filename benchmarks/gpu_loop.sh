#!/usr/bin/env bash
# The RL loop on one H200 (configs/gpu_1x_h200.gin) from an offline bundle (scripts/offline_bundle.sh,
# copied to $BUNDLE): env probe, one jailed desktop, then train.py with max_staleness=$K; logs in $OUT.
#   OUT=/tmp/out K=1 BUNDLE=/path/bundle bash benchmarks/gpu_loop.sh
set -u
export PYTHONUNBUFFERED=1
[ -d /tmp/bundle/root ] || { cp -r "${BUNDLE:-.gpu/bundle}" /tmp/bundle && chmod 755 /tmp/bundle && bash scripts/offline_install.sh /tmp/bundle > $OUT/install.log 2>&1; }
export PYTHONPATH=/tmp/bundle/site:$PWD
{ cat /etc/os-release | head -2; unshare -Ur true && echo "userns: ok"; cat /proc/sys/kernel/apparmor_restrict_unprivileged_userns; cat /proc/self/cgroup; } > $OUT/env.txt 2>&1
timeout 60 python3 benchmarks/jail_smoke.py /tmp/bundle/root > $OUT/jail.log 2>&1; echo "jail rc=$?"; tail -4 $OUT/jail.log
mkdir -p /tmp/rl; rm -rf /tmp/rl/k$K
( while sleep 15; do nvidia-smi --query-gpu=memory.used --format=csv,noheader; done > $OUT/gpumem_k$K.txt ) &
t0=$SECONDS
timeout ${LOOP_S:-540} python3 scripts/train.py --run_dir=/tmp/rl/k$K --steps=${STEPS:-3} \
  --gin_file=configs/gpu_1x_h200.gin --gin_param="RLConfig.max_staleness = $K" \
  --gin_param="RLConfig.progress_bar = False" \
  --gin_param="LocalBackendConfig.system_root = '/tmp/bundle/root'" \
  --gin_param="LocalBackendConfig.window_manager = 'blackbox'" \
  --gin_param="SamplingParams.max_new_tokens = ${NEW:-128}" > $OUT/train_k$K.log 2>&1
echo "rc=$? $((SECONDS-t0)) s"; grep -vE "^\s*$" $OUT/train_k$K.log | tail -12
cp /tmp/rl/k$K/metrics.jsonl $OUT/metrics_k$K.jsonl 2>/dev/null
python3 benchmarks/rl_loop.py --staleness $K --keep /tmp/rl --tabulate 2>&1 | tail -6
tail -2 $OUT/gpumem_k$K.txt; df -h / | tail -1
rm -rf /tmp/rl/k$K/checkpoints /tmp/rl/k$K/weights /tmp/rl/k$K/base_model
