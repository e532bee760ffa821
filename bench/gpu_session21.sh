#!/usr/bin/env bash
# GPU calls planned after session 20 (1 GPU is enough; idle release is 30 s: chain the calls). What
# issue 19 still needs a GPU for:
#   - session 20's NaN: SmolLM2 GRPO at rollout.max_new_tokens=384 had a non-finite gradient on every
#     step on the H200 (compiled or not, sampling copy or not; never at 96; not on CPU, not with
#     synthetic batches). bench/nan_replay.py replays the saved batch (bench/nan_batches/, carried)
#     under variations; then short real runs show what avoids it.
#   - §2: the DPO step under dynamic vs static compilation (session 20: ours compiled 0.085 s, 1.44×
#     TRL precomputed-ref, vs 0.076 s / 1.70× in session 14 with static compilation — but ours
#     uncompiled moved too, 0.111 -> 0.134 s, on another host), current and realistic configs.
# Modes (the GGUF fixture travels in three parts, one a call: bench/gguf_to_gpu.sh):
#   callA  GGUF part 0 + TRL wheels (carry wheels/ and the gguf wheel): dpo_step current config,
#          ours off / compiled (dynamic) / compiled static, TRL precomputed ref
#   callB  GGUF part 1 + bench/gguf_parts/smol_tok: the same on the realistic config (HH lengths, packed)
#   callC  GGUF part 2 + bench/nan_batches: the NaN replay, then 3-step real runs at 384 tokens
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mode=$1; shift

source bench/capped.sh  # capped SECONDS cmd...

case "$mode" in
callA)
    bash bench/gpu_session16.sh join 0
    CUDA_VISIBLE_DEVICES=0 capped 400 python3 bench/dpo_step.py --device cuda --compile off,on,static --trl-precompute \
        --packing off --chunked-head on --results "$OUT/dpo.md" --json "$OUT/dpo.json" 2>&1 | grep -E "^(ours|trl)|Error" | cut -c1-300
    ;;
callB)
    bash bench/gpu_session16.sh join 1
    CUDA_VISIBLE_DEVICES=0 capped 500 python3 bench/dpo_step.py --device cuda --config realistic \
        --length-tokenizer bench/gguf_parts/smol_tok --compile off,on,static --trl-precompute --packing on \
        --chunked-head on --results "$OUT/dpo-realistic.md" --json "$OUT/dpo-realistic.json" 2>&1 | grep -E "^(ours|trl)|Error" | cut -c1-300
    ;;
callC)
    bash bench/gpu_session16.sh join 2
    CUDA_VISIBLE_DEVICES=0 capped 200 python3 bench/nan_replay.py --model /tmp/smollm2 --batch bench/nan_batches/batch1.pt \
        --json "$OUT/replay.json" 2>&1 | grep -E '^\{|Error' | cut -c1-300
    [ -f /tmp/arith/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/arith > /dev/null
    for v in "t384 optim.max_steps=3" "t192 rollout.max_new_tokens=192" "masktrunc grpo.mask_truncated_completions=true" \
             "micro32 grpo.micro_batch_size=32"; do
        set -- $v
        CUDA_VISIBLE_DEVICES=0 capped 70 python3 bench/real_model_rl.py tether --model /tmp/smollm2 --out "/tmp/rl/$1" \
            --recipe lr1e5_g16 --data /tmp/arith --budget 1000 --seed 0 --set optim.max_steps=3 \
            --set rollout.max_new_tokens=384 --set rollout.sampler_copy=true --set "$2" > /dev/null 2>&1
        echo "$1: $(python3 -c "
import json
for l in open('/tmp/rl/$1/run/metrics.jsonl'):
    d = json.loads(l); print(d['step'], d.get('grad_norm'), d['completions/max_length'])" | tr '\n' ';')"
    done
    ;;
*)
    echo "unknown mode $mode (callA, callB, callC)" >&2; exit 2
    ;;
esac
