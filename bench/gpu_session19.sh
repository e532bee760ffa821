#!/usr/bin/env bash
# GPU calls planned after session 18 (4 x H100/H200 lease; idle release is 30 s: chain the calls).
# What only a GPU can measure now:
#   - the planner's one miss, 7B DPO (33.47 GB measured vs 39.17 predicted): memory_check's phases
#     (its 150 s in session 18 ran out while 4 ranks each loaded the 30 GB fp32 model);
#   - sharding.frozen_to_bf16 (a frozen reference under the bf16 policy sharded from bf16 weights):
#     7B GRPO with beta > 0 holds a reference, expect ~3.8 GB a GPU less than with fp32 shards;
#   - 0.5B GRPO weak scaling, replicated, clean (session 18's runs shared the GPUs with orphans);
#   - issue 19 section 1 (async5a, 3 seeds), whose session-16 sampler cuts are still unmeasured.
# Modes:
#   callA  GGUF part 0 + TRL wheels; builds /tmp/m7; mem7b (the 7B DPO step's phases; 7B SFT after it
#          if the call has time left)
#   callB  GGUF part 1; grpo7b with beta 0.04 (a reference held) and the released replica; grpo05
#          (replicated, 1/2/4 GPUs, compile off and on)
#   callC  GGUF part 2 (the model); async5a seeds 0 1 2 as far as the call's 600 s allow
#   callD  (if time is left) the rest of async5a: SEEDS="..." bash bench/gpu_session16.sh async5a
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mode=$1; shift

# capped SECONDS cmd...: run cmd in a process group of its own; past SECONDS the whole group is
# killed (a plain `timeout` on torchrun left its ranks holding 11-17 GB on every GPU in session 18)
capped() {
    local s=$1; shift
    setsid "$@" & local pid=$!
    ( sleep "$s"; kill -9 -- -"$pid" 2>/dev/null ) & local guard=$!
    wait "$pid"; local rc=$?
    kill "$guard" 2>/dev/null; kill -9 -- -"$pid" 2>/dev/null
    return $rc
}

case "$mode" in
callA)
    bash bench/gpu_session16.sh join 0
    [ -d /tmp/m7 ] || timeout 200 python3 bench/scale.py --shape qwen7b --gpus 4 --algos dpo --steps 1 --warmup 1 \
        --keep-model /tmp/m7 --run-timeout 150 --results /tmp/m7.md > /dev/null 2>&1
    S=(--shape qwen2.5-7b --steps 2 --gradient-checkpointing --weights-from /tmp/m7 --workdir /tmp/mc7)
    for algo in dpo sft; do  # (each rank loads the 7B model into CPU memory first: minutes, not seconds)
        left=$((580 - SECONDS)); [ $left -lt 150 ] && { echo "no time for $algo"; break; }
        CUDA_VISIBLE_DEVICES=0,1,2,3 capped $left python3 -m torch.distributed.run --nproc-per-node 4 --master-port 29750 \
            bench/memory_check.py --device cuda --out "$OUT/mem-7b.jsonl" "${S[@]}" --algo $algo \
            --batch-size 2 --grad-accum 4 --seq-len 1024 > "/tmp/mc-$algo.log" 2>&1; echo "$algo rc=$?"
        cp "/tmp/mc-$algo.log" "$OUT/"
    done
    cat "$OUT/mem-7b.jsonl"
    ;;
callB)
    bash bench/gpu_session16.sh join 1
    capped 200 python3 bench/scale.py --shape qwen7b --gpus 4 --algos grpo --steps 2 --warmup 1 --keep-model /tmp/m7 \
        --run-timeout 180 --set release_replica=true --set beta=0.04 --results "$OUT/grpo7b.md" \
        --json "$OUT/grpo7b-beta.json" 2>&1 | grep -E "^\| grpo"
    for c in false true; do
        capped 170 python3 bench/scale.py --shape qwen0.5b --gpus 1,2,4 --algos grpo --steps 4 --warmup 2 --keep-model /tmp/m05 \
            --run-timeout 80 --set fsdp=false --set compile=$c --results "$OUT/grpo05.md" --json "$OUT/grpo05-c$c.json" 2>&1 | grep -E "^\| grpo"
    done
    ;;
callC)
    bash bench/gpu_session16.sh join 2
    end=$((SECONDS + ${DEADLINE:-560}))
    for s in 0 1 2; do
        [ $((end - SECONDS)) -lt 200 ] && { echo "no time for seed $s"; break; }
        SEEDS=$s capped $((end - SECONDS)) bash bench/gpu_session16.sh async5a; echo "seed $s rc=$? at ${SECONDS}s"
    done
    (cd /tmp/rl && tar czf "$OUT/rl-async5a.tgz" --exclude='checkpoints' .)
    ;;
*)
    echo "unknown mode $mode (callA, callB, callC; then bench/gpu_session16.sh async5a)" >&2; exit 2
    ;;
esac
