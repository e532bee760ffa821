#!/usr/bin/env bash
# GPU calls planned after session 20 (ran in session 21: callB cut to --compile static, callD inlined
# with 100 s caps and 40 steps — benchmarks/RESULTS.md "Session 21"; 1 GPU is enough; idle release is 30 s: chain the calls). What
# issue 19 still needs a GPU for:
#   - session 20's NaN: SmolLM2 GRPO at rollout.max_new_tokens=384 had a non-finite gradient on every
#     step on the H200 (compiled or not, sampling copy or not; never at 96; not on CPU, not with
#     synthetic batches). Likely cause: cuDNN's SDPA backward at widths 64 more than a multiple of
#     128 (pytorch#196678; the batches were 448 wide); trainers now turn cuDNN attention off
#     (guard_attention_backward). bench/nan_replay.py replays the saved batch (bench/nan_batches/,
#     carried) by attention backend; a real 3-step run at 384 tokens must have finite gradients;
#     then the partial-rollout measurement session 20 could not make (callD).
#   - §2: the DPO step under dynamic vs static compilation (session 20: ours compiled 0.085 s, 1.44×
#     TRL precomputed-ref, vs 0.076 s / 1.70× in session 14 with static compilation — but ours
#     uncompiled moved too, 0.111 -> 0.134 s, on another host), current and realistic configs.
# Ask for kind nvidia-h200-x2 from the first call (callD needs two GPUs; a new kind is a new machine).
# carry: callA wheels, bench/gguf_parts/smollm2.gguf.part-00, bench/gguf_parts/gguf-0.19.0-py3-none-any.whl;
# callB bench/gguf_parts/smollm2.gguf.part-01, bench/gguf_parts/smol_tok; callC
# bench/gguf_parts/smollm2.gguf.part-02, bench/nan_batches; callD nothing.
# Modes (the GGUF fixture travels in three parts, one a call: bench/gguf_to_gpu.sh):
#   callA  GGUF part 0 + TRL wheels (carry wheels/ and the gguf wheel): dpo_step current config,
#          ours off / compiled (dynamic) / compiled static / only the length dynamic, TRL precomputed
#          ref; then ours compiled
#          with cuDNN attention kept (--cudnn-attention: what the guard costs or saves)
#   callB  GGUF part 1 + bench/gguf_parts/smol_tok: the same on the realistic config (HH lengths, packed)
#   callC  GGUF part 2 + bench/nan_batches: the NaN replay, then a 3-step real run at 384 tokens
#   callD  (2 GPUs, after callC: the model in /tmp) partial rollouts with a long tail, seed 0:
#          sync, sync + partial 96, 1 + 1, 1 + 1 + partial (session 20's callC again)
source "$(dirname "$0")/capped.sh"  # capped SECONDS cmd...; strict mode, cd to the root, PYTHONPATH, $OUT
mode=$1; shift

case "$mode" in
callA)
    bash bench/gpu_session16.sh join 0
    CUDA_VISIBLE_DEVICES=0 capped 400 python3 bench/dpo_step.py --device cuda --compile off,on,static,sequence --trl-precompute \
        --packing off --chunked-head on --results "$OUT/dpo.md" --json "$OUT/dpo.json" 2>&1 | grep -E "^(ours|trl)|Error" | cut -c1-300
    CUDA_VISIBLE_DEVICES=0 capped 150 python3 bench/dpo_step.py --device cuda --compile on --skip-trl --cudnn-attention \
        --packing off --chunked-head on --results "$OUT/dpo-cudnn.md" --json "$OUT/dpo-cudnn.json" 2>&1 | grep -E "^(ours|trl)|Error" | cut -c1-300
    ;;
callB)
    bash bench/gpu_session16.sh join 1
    CUDA_VISIBLE_DEVICES=0 capped 500 python3 bench/dpo_step.py --device cuda --config realistic \
        --length-tokenizer bench/gguf_parts/smol_tok --compile off,on,static,sequence --trl-precompute --packing on \
        --chunked-head on --results "$OUT/dpo-realistic.md" --json "$OUT/dpo-realistic.json" 2>&1 | grep -E "^(ours|trl)|Error" | cut -c1-300
    ;;
callC)
    bash bench/gpu_session16.sh join 2
    CUDA_VISIBLE_DEVICES=0 capped 60 python3 -m pytest -q -s -m gpu tests/test_attention_guard.py -p no:cacheprovider 2>&1 | grep -E "guard|passed|failed|rror"
    CUDA_VISIBLE_DEVICES=0 capped 200 python3 bench/nan_replay.py --model /tmp/smollm2 --batch bench/nan_batches/batch1.pt \
        --json "$OUT/replay.json" 2>&1 | grep -E '^\{|Error' | cut -c1-300
    [ -f /tmp/arith/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/arith > /dev/null
    CUDA_VISIBLE_DEVICES=0 capped 90 python3 bench/real_model_rl.py tether --model /tmp/smollm2 --out /tmp/rl/t384 \
        --recipe lr1e5_g16 --data /tmp/arith --budget 1000 --seed 0 --set optim.max_steps=3 \
        --set rollout.max_new_tokens=384 --set rollout.sampler_copy=true --set model.compile=true > /dev/null 2>&1
    echo "t384 (step, grad norm, longest completion): $(python3 -c "
import json
for l in open('/tmp/rl/t384/run/metrics.jsonl'):
    d = json.loads(l); print(d['step'], d.get('grad_norm'), d['completions/max_length'])" | tr '\n' ';')"
    ;;
callD)
    bash bench/gpu_session20.sh callC
    ;;
*)
    echo "unknown mode $mode (callA, callB, callC, callD)" >&2; exit 2
    ;;
esac
