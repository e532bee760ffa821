#!/usr/bin/env bash
# GPU calls planned after session 19 (a 2-GPU lease; idle release is 30 s: chain the calls). What
# issue 19 still needs a GPU for:
#   - §2 again: session 19 made model.compile dynamic-shaped from the first call (no recompilation
#     at a new length); the DPO step's compiled numbers (0.076 s, 1.70× TRL, session 14) were
#     measured with static compilation — does a fixed-shape step lose anything?
#   - §1 (a): does the interleaved placement (one GPU) help at 0.5B? (measured at 135M only: 0.85-0.97×)
#   - §1 partial rollouts on a GPU, on a batch with a long tail of lengths (measured on CPU only,
#     where the tail is cheap): SmolLM2 with 384 new tokens, partial 96 vs not, sync and 1 + 1.
# Modes (the GGUF fixture travels in three parts, one a call: bench/gguf_to_gpu.sh):
#   callA  GGUF part 0 + TRL wheels (carry wheels/ and the gguf wheel too): dpo_step compiled, ours
#          and TRL's (session 14 gave it 520 s)
#   callB  GGUF part 1: 0.5B GRPO on one GPU, synchronous vs interleaved staleness 1, compiled
#   callC  GGUF part 2: partial rollouts, seed 0 (sync, sync + partial, 1 + 1, 1 + 1 + partial)
source "$(dirname "$0")/capped.sh"  # capped SECONDS cmd...; strict mode, cd to the root, PYTHONPATH, $OUT
mode=$1; shift

case "$mode" in
callA)
    bash bench/gpu_session16.sh join 0
    CUDA_VISIBLE_DEVICES=0 capped 540 python3 bench/dpo_step.py --device cuda --compile both --trl-precompute --trl-compile \
        --packing off --chunked-head on --results "$OUT/dpo.md" --json "$OUT/dpo.json" 2>&1 | grep -E "^(ours|trl)|Error" | cut -c1-300
    ;;
callB)
    bash bench/gpu_session16.sh join 1
    for q in "auto 0" "interleaved 1"; do  # (synchronous: auto at staleness 0; scale.py samples from the bf16 copy on 1 GPU)
        set -- $q
        CUDA_VISIBLE_DEVICES=0 capped 200 python3 bench/scale.py --shape qwen0.5b --gpus 1 --algos grpo --steps 10 --warmup 3 \
            --keep-model /tmp/m05 --run-timeout 190 --set compile=true \
            --set queue.placement=$1 --set queue.max_staleness=$2 \
            --results "$OUT/inter05.md" --json "$OUT/inter05-$1.json" 2>&1 | grep -E "^\| grpo|rror"
    done
    ;;
callC)
    [ -f /tmp/smollm2/config.json ] || bash bench/gpu_session16.sh join 2  # (session 21's callD: joined already)
    [ -f /tmp/arith/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/arith; mkdir -p /tmp/rl
    long=(--recipe lr1e5_g16 --data /tmp/arith --budget 100000 --seed 0 --eval-every 30 --set optim.max_steps=60
          --set rollout.max_new_tokens=384 --set rollout.sampler_copy=true --set model.compile=true)
    disagg=(--nproc 2 --set queue.placement=disaggregated --set queue.max_staleness=1)
    partial=(--set queue.partial=true --set queue.partial_tokens=96)
    run() { local gpus=$1 name=$2; shift 2
        CUDA_VISIBLE_DEVICES=$gpus capped 140 python3 bench/real_model_rl.py tether --model /tmp/smollm2 --out "/tmp/rl/p-$name-s0" \
            "${long[@]}" "$@" > "/tmp/rl/p-$name-s0.log" 2>&1; echo "$name rc=$? at ${SECONDS}s"; }
    run 0 sync; run 0 syncpartial "${partial[@]}"; run 0,1 disagg "${disagg[@]}"; run 0,1 disaggpartial "${disagg[@]}" "${partial[@]}"
    python3 bench/async_summary.py /tmp/rl/p-* --json "$OUT/partial.json" | tee "$OUT/partial.md"
    (cd /tmp/rl && tar czf "$OUT/rl-partial.tgz" --exclude='checkpoints' p-*)
    ;;
*)
    echo "unknown mode $mode (callA, callB, callC)" >&2; exit 2
    ;;
esac
