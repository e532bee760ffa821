#!/usr/bin/env bash
# GPU calls planned after session 21 (one GPU: kind nvidia-h200; idle release is 30 s: chain the calls).
#   - Session 21 replaced "no cuDNN attention while training" (session 20's fix for cuDNN's NaN
#     backward, which cost the compiled DPO step 22 %) by 16 masked keys more at key lengths
#     ≡ 64 (mod 128) (tether/models/attention.py). Tested on CPU only: callA's GPU test and callC's
#     replay (as trained / guarded / guarded with only cuDNN) must show finite gradients.
#   - §2 with cuDNN back on: the DPO step compiled dynamic (the default) and static, both configs.
#   - partial rollouts: where a round's sampling time goes (bench/partial_profile.py, per sampler call).
# carry: callA wheels, bench/gguf_parts/smollm2.gguf.part-00, bench/gguf_parts/gguf-0.19.0-py3-none-any.whl;
# callB bench/gguf_parts/smollm2.gguf.part-01, bench/gguf_parts/smol_tok; callC
# bench/gguf_parts/smollm2.gguf.part-02, bench/nan_batches (git-ignored: saved in session 20 by
# bench/nan_dump.py; only in /work/main).
source "$(dirname "$0")/capped.sh"  # capped SECONDS cmd...; strict mode, cd to the root, PYTHONPATH, $OUT
mode=$1; shift

case "$mode" in
callA)
    bash bench/gpu_session16.sh join 0
    CUDA_VISIBLE_DEVICES=0 capped 60 python3 -m pytest -q -s -m gpu tests/test_attention_guard.py -p no:cacheprovider 2>&1 | grep -E "guard|passed|failed|rror"
    CUDA_VISIBLE_DEVICES=0 capped 300 python3 bench/dpo_step.py --device cuda --compile on,static --trl-precompute \
        --packing off --chunked-head on --results "$OUT/dpo.md" --json "$OUT/dpo.json" 2>&1 | grep -E "^(ours|trl)|Error" | cut -c1-300
    CUDA_VISIBLE_DEVICES=0 capped 100 python3 bench/dpo_step.py --device cuda --compile static --skip-trl --no-cudnn-attention \
        --packing off --chunked-head on --results "$OUT/dpo-nocudnn.md" --json "$OUT/dpo-nocudnn.json" 2>&1 | grep -E "^(ours|trl)|Error" | cut -c1-300
    ;;
callB)
    bash bench/gpu_session16.sh join 1
    CUDA_VISIBLE_DEVICES=0 capped 420 python3 bench/dpo_step.py --device cuda --config realistic \
        --length-tokenizer bench/gguf_parts/smol_tok --compile on,static --trl-precompute --packing on \
        --chunked-head on --results "$OUT/dpo-realistic.md" --json "$OUT/dpo-realistic.json" 2>&1 | grep -E "^(ours|trl)|Error" | cut -c1-300
    ;;
callC)
    bash bench/gpu_session16.sh join 2
    CUDA_VISIBLE_DEVICES=0 capped 120 python3 bench/nan_replay.py --quick --model /tmp/smollm2 --batch bench/nan_batches/batch1.pt \
        --json "$OUT/replay.json" 2>&1 | grep -E '^\{|Error' | cut -c1-300
    [ -f /tmp/arith/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/arith > /dev/null
    # where a partial round's 1.0-1.3 s of sampling goes (session 21): per sampler call, constant weights
    CUDA_VISIBLE_DEVICES=0 capped 120 python3 bench/partial_profile.py --model /tmp/smollm2 --data /tmp/arith \
        --device cuda --steps 12 --json "$OUT/partial-profile.json" 2>&1 | grep -E "step (0|1|5|11):|==|Error" | cut -c1-600
    mkdir -p /tmp/rl  # session 21's synchronous 384-token run again (there without cuDNN): rollout and step seconds
    CUDA_VISIBLE_DEVICES=0 capped 110 python3 bench/real_model_rl.py tether --model /tmp/smollm2 --out /tmp/rl/p-sync-s0 \
        --recipe lr1e5_g16 --data /tmp/arith --budget 100000 --seed 0 --eval-every 1000 --set optim.max_steps=40 \
        --set rollout.max_new_tokens=384 --set rollout.sampler_copy=true --set model.compile=true > /tmp/rl/p-sync-s0.log 2>&1
    python3 bench/async_summary.py /tmp/rl/p-* --json "$OUT/sync384.json" | tee "$OUT/sync384.md"
    python3 -c "
import json
rows = [json.loads(l) for l in open('/tmp/rl/p-sync-s0/run/metrics.jsonl') if 'grad_norm' in l]
print('steps', len(rows), 'refused', max(r.get('skipped_steps', 0) for r in rows), 'grad norms finite',
      all(r['grad_norm'] == r['grad_norm'] for r in rows))"
    ;;
*)
    echo "unknown mode $mode (callA, callB, callC)" >&2; exit 2
    ;;
esac
