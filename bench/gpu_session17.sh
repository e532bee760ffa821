#!/usr/bin/env bash
# GPU calls planned after session 16 — everything FSDP2 measured again now that the bf16
# MixedPrecisionPolicy reaches GPU runs (session 16: setup.shard_model chose it by the weights'
# device, the CPU at sharding time, so sessions 9-16 gathered fp32 layers and cast at each use).
# One mode per device call, on a 4-GPU lease unless said:
#   smoke    FIRST: every trainer under torchrun on 2 GPUs (bench/gpu_smoke.py), now in bf16 FSDP2
#   like7b   7B DPO like with like vs TRL 1.16 (bf16 reduce on both; then fp32 on both), then a
#            traced step (no fp32 [18944, 3584] weight should reach aten::linear now). Carry wheels/.
#   grpo7b   7B GRPO: default and rollout.release_replica=true (session 16 without the policy:
#            64.8 / 50.1 GiB vs TRL's 41.1; 6.05 / 6.89 s)
#   dpo05    Qwen2.5-0.5B DPO with FSDP2 on 1/2/4 GPUs (weak scaling), and fsdp=false beside it
#   mem      the planner's FSDP2 rows again (0.5B sft/dpo/ppo/lora on 2 and 4 GPUs; 7B sft on 4):
#            `tether memory` vs measured, target within 10 %
# and, from bench/gpu_session16.sh (same modes, unchanged): `tests` (the GPU tests: the Sampler's
# syncs are per stream now), `join 0/1/2` (the real model), `async5a` (sync vs disaggregated, 3
# seeds one at a time: Rollout.completion_lists should shorten the sampler's 25-30 ms of scoring),
# `async5b` (interleaved staleness 4 none / tis / mis, now evaluating the bf16 copy, and with the
# per-stream syncs: does the interleaved placement overlap at last?)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mode=$1; shift

mc() {  # mc TAG NPROC DEVICES PORT TIMEOUT args...: one memory_check run (one JSON line per run)
    local tag=$1 n=$2 dev=$3 port=$4 t=$5; shift 5
    local run=(python3)
    [ "$n" -gt 1 ] && run=(python3 -m torch.distributed.run --nproc-per-node "$n" --master-port "$port")
    CUDA_VISIBLE_DEVICES=$dev timeout "$t" "${run[@]}" bench/memory_check.py --device cuda --out "$OUT/mem-$tag.jsonl" "$@" \
        > "$OUT/mc-$tag.log" 2>&1
    echo "mc $tag rc=$?"
}

case "$mode" in
smoke)
    timeout 500 python3 bench/gpu_smoke.py --nproc 2 --out "$OUT/smoke.json" 2>&1 | tail -20
    ;;
smokemem)  # smoke on GPUs 0,1 beside the planner's 2-GPU rows on GPUs 2,3 (peaks are per process)
    ( CUDA_VISIBLE_DEVICES=0,1 timeout 470 python3 bench/gpu_smoke.py --nproc 2 --out "$OUT/smoke.json" \
        > "$OUT/smoke.log" 2>&1; echo "smoke rc=$?" ) &
    S=(--shape qwen2.5-0.5b --steps 3)
    ( mc dpo2 2 2,3 29730 120 "${S[@]}" --workdir /tmp/mcC --algo dpo --batch-size 2 --grad-accum 4 --seq-len 1024
      mc sft2 2 2,3 29732 120 "${S[@]}" --workdir /tmp/mcC --algo sft --batch-size 4 --grad-accum 4 --seq-len 1024
      mc off2 2 2,3 29731 140 "${S[@]}" --workdir /tmp/mcE --algo sft --batch-size 4 --grad-accum 4 --seq-len 1024 --fsdp-offload ) &
    wait
    tail -25 "$OUT/smoke.log"; cat "$OUT"/mem-*.jsonl
    for f in "$OUT"/mc-*.log; do echo "== $f"; tail -3 "$f"; done
    ;;
like7b)
    python3 -m pip install -q --no-index --no-deps wheels/*.whl 2>&1 | tail -1
    common=(--shape qwen7b --gpus 4 --algos dpo --steps 5 --warmup 2 --keep-model /tmp/m7 --run-timeout 200 --trl-timeout 280)
    timeout 330 python3 bench/scale.py "${common[@]}" --trl --set fsdp_reduce=bf16 --results "$OUT/like7b-bf16.md" \
        --json "$OUT/like7b-bf16.json" 2>&1 | grep -E "^\| (dpo|TRL)" | cut -c1-300
    timeout 150 python3 bench/scale.py "${common[@]}" --set fsdp_reduce=bf16 --steps 2 --trace /tmp/t7 \
        --results /tmp/t7.md > /dev/null 2>&1
    (cd bench && python3 trace_busy.py /tmp/t7/*rank0*.gz) | tee "$OUT/like7b-busy.txt"
    (cd bench && python3 trace_gaps.py /tmp/t7/*rank0*.gz) | tee "$OUT/like7b-gaps.txt"
    cp /tmp/t7/*rank0*.gz "$OUT/" 2>/dev/null
    ;;
like7b32)  # the fp32-reduce pair, if the first call left time
    python3 -m pip install -q --no-index --no-deps wheels/*.whl 2>&1 | tail -1
    timeout 330 python3 bench/scale.py --shape qwen7b --gpus 4 --algos dpo --steps 5 --warmup 2 --keep-model /tmp/m7 \
        --run-timeout 200 --trl-timeout 280 --trl --trl-reduce fp32 --results "$OUT/like7b-fp32.md" \
        --json "$OUT/like7b-fp32.json" 2>&1 | grep -E "^\| (dpo|TRL)" | cut -c1-300
    ;;
grpo7b)  # the same two runs as session 16's
    bash bench/gpu_session16.sh grpo7b
    ;;
dpo05)
    timeout 400 python3 bench/scale.py --shape qwen0.5b --gpus 1,2,4 --algos dpo --steps 5 --warmup 2 --keep-model /tmp/m05 \
        --run-timeout 110 --results "$OUT/dpo05.md" --json "$OUT/dpo05.json" 2>&1 | grep -E "^\| dpo"
    timeout 180 python3 bench/scale.py --shape qwen0.5b --gpus 1,4 --algos dpo --steps 5 --warmup 2 --keep-model /tmp/m05 \
        --run-timeout 80 --set fsdp=false --results "$OUT/dpo05.md" --json "$OUT/dpo05-replicated.json" 2>&1 | grep -E "^\| dpo"
    ;;
mem)
    S=(--shape qwen2.5-0.5b --steps 3)
    ( mc dpo2 2 0,1 29730 120 "${S[@]}" --workdir /tmp/mcC --algo dpo --batch-size 2 --grad-accum 4 --seq-len 1024
      mc sft2 2 0,1 29732 120 "${S[@]}" --workdir /tmp/mcC --algo sft --batch-size 4 --grad-accum 4 --seq-len 1024 ) &
    ( mc off2 2 2,3 29731 140 "${S[@]}" --workdir /tmp/mcE --algo sft --batch-size 4 --grad-accum 4 --seq-len 1024 --fsdp-offload ) &
    wait
    mc lora4 4 0,1,2,3 29740 120 "${S[@]}" --workdir /tmp/mcD --algo sft --batch-size 4 --grad-accum 4 --seq-len 1024 --lora-r 16
    mc ppo4 4 0,1,2,3 29741 120 "${S[@]}" --workdir /tmp/mcD --algo ppo --prompts 16 --generations 1 --prompt-len 128 \
        --new-tokens 384 --minibatches 4 --gradient-checkpointing
    cat "$OUT"/mem-*.jsonl
    ;;
esac
