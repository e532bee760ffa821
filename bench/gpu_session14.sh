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
#            at staleness 1, 3 seeds; interleaved staleness 4 none / tis)
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
    OUT=$OUT bash bench/gpu_session13.sh grpo16
    ;;
dpo7b)
    join 2
    timeout 560 python3 bench/scale.py --shape qwen7b --gpus 4 --algos dpo --trl --steps 5 --warmup 2 \
        --keep-model /tmp/m7 --run-timeout 200 --trl-timeout 280 --results "$OUT/dpo7b.md" \
        --json "$OUT/dpo7b.json" --log-dir "$OUT/logs7" 2>&1 | grep -E "^\| dpo|^dpo|rror" | cut -c1-400
    ;;
async3)
    OUT=$OUT STEPS=${STEPS:-100} bash bench/gpu_session13.sh async3
    ;;
esac
