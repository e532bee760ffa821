#!/usr/bin/env bash
# Session 12's GPU calls, one mode per device call (a 4-GPU machine held across the calls):
#   join <k>      append GGUF part k (bench/gpu_session11.sh join; carry the part, part 0 also the
#                 gguf wheel); with k=0 also the TRL wheels (carry wheels) and the NCCL probe (nccl below), the machine is held anyway
#   nccl          bench/nccl_probe.py on 2 and 4 GPUs + the transport NCCL chose (NCCL_DEBUG=INFO)
#   estimators2|estimators3 <budget>   issue 17: the β2-matched tether-vs-TRL runs (gpu_session11.sh)
#   scale16       issue 16: DPO and GRPO (Qwen2.5-0.5B shape) on 1, 2, 4 GPUs after the session-12
#                 changes (bench/scale.py)
#   syncs         DPO and GRPO on 2 GPUs with CUDA sync debugging: the stacks that wait (bench/sync_debug)
# Everything it writes goes under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mode=$1; shift

nccl() {
    for n in 2 4; do
        NCCL_DEBUG=INFO timeout 120 torchrun --nproc-per-node $n bench/nccl_probe.py > /tmp/nccl-$n.log 2>&1
        grep -E "^\|" /tmp/nccl-$n.log
        grep -E "via (P2P|SHM|NET)|NCCL version|P2P is disabled|CUMEM" /tmp/nccl-$n.log | sed 's/^[^ ]* //' | sort | uniq -c | head -8
    done
    cp /tmp/nccl-2.log /tmp/nccl-4.log "$OUT"/ 2>/dev/null
    nvidia-smi topo -m 2>&1 | head -8
}

case "$mode" in
join)
    bash bench/gpu_session11.sh join "$1"
    if [ "$1" = 0 ]; then  # TRL 1.16 for the estimator runs (carried wheels/), then the probe
        python3 -m pip install -q --no-index --no-deps wheels/*.whl 2>&1 | tail -2
        python3 -c "import trl; print('trl', trl.__version__)"
        nccl
    fi
    ;;
nccl) nccl ;;
estimators2|estimators3) bash bench/gpu_session11.sh "$mode" "$@" ;;
syncs)  # where rank 0 waits on the GPU: DPO and GRPO on 2 GPUs with sync debugging (bench/sync_debug)
    for algo in dpo grpo; do
        PYTHONPATH=$PWD/bench/sync_debug:$PWD SYNC_DEBUG_OUT=$OUT/syncs-$algo.txt timeout 200 python3 bench/scale.py \
            --shape qwen0.5b --gpus 2 --algos $algo --steps 3 --warmup 1 --keep-model /tmp/m05 \
            --results /tmp/syncs.md --run-timeout 150 "$@" 2>&1 | grep -E "^\| (dpo|grpo)" | tail -2
        head -40 "$OUT/syncs-$algo.txt"
    done
    ;;
scale16)
    timeout 560 python3 bench/scale.py --shape qwen0.5b --gpus 1,2,4 --algos dpo,grpo --steps 4 --warmup 2 \
        --keep-model /tmp/m05 --results "$OUT/scale.md" --json "$OUT/scale.json" --run-timeout 150 \
        --log-dir "$OUT/scale-logs" "$@" 2>&1 | grep -E "^\||×|rror" | tail -20
    ;;
esac
