#!/usr/bin/env bash
# GPU calls of session 14, one mode per device call on a 4-GPU machine held across the calls; each
# of the first three also appends one part of the GGUF (carry it: bench/gguf_parts/smollm2.gguf.part-0k;
# part 0 with the gguf wheel and wheels/ for TRL), so async3 can run on the real model after them:
#   dpo19    issue 19 §2, current config (8 pairs x 383 tokens, one H200/H100): ours plain and
#            compiled (model.compile) vs TRL with a precomputed reference, plain and torch_compile;
#            one extra step of each traced (bench/trace_busy.py: GPU busy vs span, launches)
#   grpo16   issue 16: bench/gpu_session13.sh grpo16 (GRPO fsdp=false 1 (bf16 copy) / 2 / 4 GPUs,
#            micro-batch 8 and 16: the spread of session 13's single 1.71x / 3.37x)
#   dpo7b    issue 16: 7B-shape DPO on 4 GPUs after the LM head became an FSDP2 unit of its own,
#            tether vs TRL 1.16 on the same machine, 5 timed steps each
#   async3   issue 19 §1: bench/gpu_session13.sh async3 (sampler_copy: synchronous vs disaggregated
#            at staleness 1, 3 seeds; interleaved staleness 4 none / tis) on 4 GPUs; on 2 GPUs the
#            same runs in two calls: async3a (join 2, then disaggregated seeds 0-2 on GPUs 0+1) and
#            async3b (synchronous seeds 0-2 on GPU 0 beside interleaved none / tis on GPU 1)
# When only 2-GPU machines are lent: GPUS=2 for grpo16 (1 and 2 GPUs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mode=$1; shift

join() {  # join <k>: GGUF part k (and, with part 0, TRL's wheels)
    bash bench/gpu_session11.sh join "$1" 2>&1 | tail -1
    [ "$1" = 0 ] && python3 -m pip install -q --no-index --no-deps wheels/*.whl 2>&1 | tail -2
    return 0
}

case "$mode" in
dpo19)
    join 0
    timeout 520 python3 bench/dpo_step.py --device cuda --compile both --trl-precompute --trl-compile \
        --packing off --chunked-head on --trace /tmp/dtr --results "$OUT/dpo19.md" --json "$OUT/dpo19.json" \
        2>&1 | grep -E "^(ours|trl)|Error|error" | cut -c1-300
    (cd bench && python3 trace_busy.py /tmp/dtr/*.json.gz) > "$OUT/dpo19-busy.txt" 2>&1
    cat "$OUT/dpo19-busy.txt"; tar czf "$OUT/dpo19-traces.tgz" -C /tmp dtr
    ;;
grpo16)
    join 1
    common=(--shape qwen0.5b --steps 3 --warmup 2 --keep-model /tmp/m05 --run-timeout 110 --algos grpo)
    for mb in 8 16; do
        timeout 90 python3 bench/scale.py "${common[@]}" --gpus 1 --micro-batch $mb --set rollout.sampler_copy=true \
            --results /tmp/g1.md --json "$OUT/grpo1-copy-mb$mb.json" | grep -E "^\| grpo" | tail -1
        timeout 200 python3 bench/scale.py "${common[@]}" --gpus "${GPUS:-2,4}" --micro-batch $mb --set fsdp=false \
            --results /tmp/g2.md --json "$OUT/grpo-repl-mb$mb.json" | grep -E "^\| grpo" | tail -2
    done
    ;;
dpo7b)
    [ -n "${JOIN:-}" ] && join 2
    timeout 560 python3 bench/scale.py --shape qwen7b --gpus 4 --algos dpo --trl --steps 5 --warmup 2 \
        --keep-model /tmp/m7 --run-timeout 200 --trl-timeout 280 --results "$OUT/dpo7b.md" \
        --json "$OUT/dpo7b.json" --log-dir "$OUT/logs7" 2>&1 | grep -E "^\| dpo|^dpo|rror" | cut -c1-400
    ;;
grpo4)  # issue 16: GRPO fsdp=false on 1 (bf16 copy) and 4 GPUs, micro-batch 8 (no GGUF needed)
    common=(--shape qwen0.5b --steps 3 --warmup 2 --keep-model /tmp/m05 --run-timeout 110 --algos grpo)
    timeout 90 python3 bench/scale.py "${common[@]}" --gpus 1 --set rollout.sampler_copy=true \
        --results /tmp/g1.md --json "$OUT/grpo1-copy-x4.json" | grep -E "^\| grpo" | tail -1
    timeout 300 python3 bench/scale.py "${common[@]}" --gpus 4,2 --set fsdp=false \
        --results /tmp/g2.md --json "$OUT/grpo-repl-x4.json" | grep -E "^\| grpo" | tail -2
    ;;
async3)
    OUT=$OUT STEPS=${STEPS:-100} bash bench/gpu_session13.sh async3
    ;;
async3a|async3b)
    [ "$mode" = async3a ] && join 2
    [ -f /tmp/arith/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/arith
    mkdir -p /tmp/rl
    rl() {  # rl <gpu(s)> <name> [real_model_rl.py args...] (as bench/gpu_session13.sh)
        local gpus=$1 name=$2; shift 2
        CUDA_VISIBLE_DEVICES=$gpus python3 bench/real_model_rl.py tether --model /tmp/smollm2 --out "/tmp/rl/$name" \
            --recipe lr1e5_g16 "$@" > "/tmp/rl/$name.log" 2>&1
    }
    common=(--data /tmp/arith --budget 100000 --eval-every 50 --set optim.max_steps=${STEPS:-100} --set rollout.sampler_copy=true)
    if [ "$mode" = async3a ]; then
        for s in 0 1 2; do rl 0,1 copy-disagg1-s$s "${common[@]}" --seed $s --nproc 2 \
            --set queue.placement=disaggregated --set queue.max_staleness=1; done
    else
        (for s in 0 1 2; do rl 0 copy-sync-s$s "${common[@]}" --seed $s; done) &
        (for c in none tis; do rl 1 copy-inter4-$c-s0 "${common[@]}" --seed 0 --set queue.placement=interleaved \
            --set queue.max_staleness=4 --set grpo.is_correction=$c; done) &
        wait
    fi
    (cd /tmp/rl && tar czf "$OUT/rl-$mode.tgz" --exclude='*.safetensors' --exclude='checkpoints' .)
    tail -2 /tmp/rl/*.log | cut -c1-300
    ;;
esac
