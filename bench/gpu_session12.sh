#!/usr/bin/env bash
# Session 12's GPU calls, one mode per device call (a 4-GPU machine held across the calls):
#   join <k>      append GGUF part k (bench/gpu_session11.sh join; carry the part, part 0 also the
#                 gguf wheel); with k=0 also the TRL wheels (carry wheels) and the NCCL probe (nccl below), the machine is held anyway
#   nccl          bench/nccl_probe.py on 2 and 4 GPUs + the transport NCCL chose (NCCL_DEBUG=INFO)
#   estimators2|estimators3 <budget>   issue 17: the β2-matched tether-vs-TRL runs (gpu_session11.sh)
#   scale16       issue 16: syncs (below), then DPO (Qwen2.5-0.5B shape) on 1, 2, 4 GPUs and on 2, 4
#                 with model.fsdp_defer_sync=true (bench/scale.py)
#   lease2        issue 16: syncs, cProfile of rank 0, DPO/GRPO scaling with fsdp_defer_sync / fsdp_unit_layers
#   lease3        issue 16: DPO with fsdp_unit_layers=24, sharded and replicated
#   syncs         DPO on 2 GPUs with CUDA sync debugging: the stacks that wait (bench/sync_debug)
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
syncs)  # where rank 0 waits on the GPU: DPO on 2 GPUs with sync debugging (bench/sync_debug)
    PYTHONPATH=$PWD/bench/sync_debug:$PWD SYNC_DEBUG_OUT=$OUT/syncs-dpo.txt timeout 100 python3 bench/scale.py \
        --shape qwen0.5b --gpus 2 --algos dpo --steps 3 --warmup 1 --keep-model /tmp/m05 \
        --results /tmp/syncs.md --run-timeout 90 "$@" 2>&1 | grep -E "^\| dpo" | tail -1
    head -30 "$OUT/syncs-dpo.txt"
    ;;
lease2)  # issue 16 after the first lease: syncs, rank 0's Python profile on 1 and 2 GPUs, then DPO
         # 1/2/4 GPUs plain, with fsdp_defer_sync, and with defer + 4 layers a unit; GRPO 2/4 with both
    bash "$0" syncs
    for g in 1 2; do
        PYTHONPATH=$PWD/bench/sync_debug:$PWD CPROFILE_OUT=$OUT/cprofile-dpo$g.txt timeout 90 python3 bench/scale.py \
            --shape qwen0.5b --gpus $g --algos dpo --steps 4 --warmup 2 --keep-model /tmp/m05 \
            --results /tmp/cprof.md --run-timeout 80 2>&1 | grep -E "^\| dpo" | tail -1
    done
    common=(--shape qwen0.5b --steps 4 --warmup 2 --keep-model /tmp/m05 --run-timeout 80)
    sc() {  # sc <name> <algos> <gpus> [--set ...]
        local name=$1 algos=$2 gpus=$3; shift 3
        timeout 170 python3 bench/scale.py "${common[@]}" --algos $algos --gpus $gpus --results "$OUT/$name.md" \
            --json "$OUT/$name.json" "$@" 2>&1 | grep -E "^\| (dpo|grpo)|rror" | tail -4
    }
    sc dpo-plain dpo 1,2,4
    sc dpo-defer dpo 2,4 --set fsdp_defer_sync=true
    sc dpo-defer-unit4 dpo 2,4 --set fsdp_defer_sync=true --set fsdp_unit_layers=4
    sc grpo-defer-unit4 grpo 2,4 --set fsdp_defer_sync=true --set fsdp_unit_layers=4
    ;;
lease3)  # issue 16, the last minutes: DPO with all 24 layers in one FSDP2 unit (fewer collectives
         # and hooks), sharded (1, 2, 4 GPUs) and replicated (fsdp=false; 2, 4)
    common=(--shape qwen0.5b --algos dpo --steps 3 --warmup 2 --keep-model /tmp/m05 --run-timeout 70)
    timeout 140 python3 bench/scale.py "${common[@]}" --gpus 1,2,4 --set fsdp_unit_layers=24 \
        --results "$OUT/dpo-unit24.md" --json "$OUT/dpo-unit24.json" 2>&1 | grep -E "^\| dpo|rror" | tail -4
    timeout 85 python3 bench/scale.py "${common[@]}" --gpus 2,4 --set fsdp=false --set fsdp_unit_layers=24 \
        --results "$OUT/dpo-replicate-unit24.md" --json "$OUT/dpo-replicate-unit24.json" 2>&1 | grep -E "^\| dpo|rror" | tail -4
    ;;
scale16)  # the sync stacks first (short), then DPO's scaling with and without fsdp_defer_sync
    bash "$0" syncs
    common=(--shape qwen0.5b --algos dpo --steps 4 --warmup 2 --keep-model /tmp/m05 --run-timeout 150)
    timeout 200 python3 bench/scale.py "${common[@]}" --gpus 1,2,4 --results "$OUT/scale.md" \
        --json "$OUT/scale.json" --log-dir "$OUT/scale-logs" "$@" 2>&1 | grep -E "^\||×|rror" | tail -8
    timeout 160 python3 bench/scale.py "${common[@]}" --gpus 2,4 --results "$OUT/scale-defer.md" \
        --json "$OUT/scale-defer.json" --log-dir "$OUT/scale-defer-logs" --set fsdp_defer_sync=true "$@" 2>&1 \
        | grep -E "^\||×|rror" | tail -8
    ;;
esac
