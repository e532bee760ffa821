#!/usr/bin/env bash
# GPU calls of sessions 13 and 14 (session 13 ran diag16 and repl16; next: grpo16, then join 0/1/2 and
# async3 for issue 19, or entropy for issue 17's open question),
# one mode per device call on a 4-GPU machine held across the calls:
#   join <k>    GGUF part k (carry bench/gguf_parts/smollm2.gguf.part-0k; part 0 also the gguf wheel
#               and wheels/ for TRL): three calls before the real-model modes
#   diag16      issue 16 (session 13): DPO 0.5B 1 and 2 GPUs traced (bench/trace_busy.py: GPU busy vs
#               span, launches), two independent 1-GPU runs at once, one process sharded by FSDP2
#               (--world1), and compile=true on 1/2/4
#   grpo16      issue 16 (next): GRPO fsdp=false 1(bf16 copy)/2/4 again, micro-batch 8 and 16
#   repl16      issue 16: DPO 1/2/4 with fsdp=false (plain replication, session 13), DPO 2/4 FSDP2 on the
#               same machine, GRPO 1/2/4 fsdp=false
#   trace16     issue 16 (no GGUF needed): DPO 0.5B on 2 GPUs with every rank's trace and
#               bench/trace_skew.py's verdict (which rank arrives last at each collective, and what
#               its CPU was doing), plain and with one micro-batch a step (--micro-batch 16); then
#               DPO 1/2/4 GPUs with one micro-batch and no gradient checkpointing (fewer FSDP2 passes),
#               and GRPO 1/2/4 plain (a same-machine GRPO baseline; session 12 has none)
#   async3      issue 19 §1 with rollout.sampler_copy (sampling from a bf16 copy): GPU 0 the
#               synchronous loop, GPUs 1-2 disaggregated staleness 1, seeds 0,1,2, STEPS steps; GPU 3
#               interleaved staleness 4 with none and tis (seed 0)
#   entropy     issue 17's open question (TRL's entropy falls 2-3x lower): tether GRPO with
#               sampler_copy (GPUs 0-1, seeds 0/1) and with the chunked head's torch path
#               (--no-head-kernels, GPUs 2-3), 270 s each; compare entropy per step with
#               benchmarks/real_model/curves and reward_vs_step.json (TRL's, session 12)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-100}
mode=$1; shift

rl() {  # rl <gpu(s)> <name> [real_model_rl.py args...]
    local gpus=$1 name=$2; shift 2
    CUDA_VISIBLE_DEVICES=$gpus python3 bench/real_model_rl.py tether --model /tmp/smollm2 --out "/tmp/rl/$name" \
        --recipe lr1e5_g16 "$@" > "/tmp/rl/$name.log" 2>&1
}

case "$mode" in
join)
    bash bench/gpu_session11.sh join "$1"
    [ "$1" = 0 ] && python3 -m pip install -q --no-index --no-deps wheels/*.whl 2>&1 | tail -2
    ;;
diag16)  # issue 16: is the 2-process overhead FSDP2's own, the host's, or CPU-bound launching?
    common=(--shape qwen0.5b --steps 3 --warmup 2 --keep-model /tmp/m05 --run-timeout 100 --algos dpo)
    s() { grep -E "^\| dpo" | tail -4; }
    timeout 200 python3 bench/scale.py "${common[@]}" --gpus 1,2 --trace /tmp/tA --results /tmp/a.md | s
    (cd bench && python3 trace_busy.py /tmp/tA/*.gz; python3 trace_skew.py /tmp/tA/dpo2-rank0.json.gz /tmp/tA/dpo2-rank1.json.gz) \
        2>&1 | tee "$OUT/busy-plain.txt"
    echo "--- two independent 1-GPU runs at once (GPUs 0 and 1)"
    CUDA_VISIBLE_DEVICES=0 timeout 120 python3 bench/scale.py "${common[@]}" --gpus 1 --port-base 29600 \
        --results /tmp/b0.md --json "$OUT/concurrent-gpu0.json" > /tmp/b0.log 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 120 python3 bench/scale.py "${common[@]}" --gpus 1 --port-base 29700 \
        --results /tmp/b1.md --json "$OUT/concurrent-gpu1.json" > /tmp/b1.log 2>&1 &
    wait; s < /tmp/b0.log; s < /tmp/b1.log
    echo "--- one process sharded by FSDP2 (a one-rank group)"
    timeout 120 python3 bench/scale.py "${common[@]}" --gpus 1 --world1 --results /tmp/c.md \
        --json "$OUT/world1.json" --log-dir /tmp/clog | s; grep -h world1: /tmp/clog/*.log | head -2
    echo "--- compile=true"
    timeout 260 python3 bench/scale.py "${common[@]}" --gpus 1,2,4 --set compile=true --results /tmp/d.md \
        --json "$OUT/compile.json" --log-dir /tmp/dlog | s
    tail -3 /tmp/dlog/*.log | grep -i error | head -3
    ;;
grpo16)  # issue 16 next: GRPO fsdp=false spread (session 13 had one run: 1.71x / 3.37x) and one
    # micro-batch of 16 (fewer passes: the step is CPU-bound); 1 GPU samples from a bf16 copy as ranks do
    common=(--shape qwen0.5b --steps 3 --warmup 2 --keep-model /tmp/m05 --run-timeout 110 --algos grpo)
    s() { grep -E "^\| grpo" | tail -4; }
    for mb in 8 16; do
        timeout 90 python3 bench/scale.py "${common[@]}" --gpus 1 --micro-batch $mb --set rollout.sampler_copy=true \
            --results /tmp/g1.md --json "$OUT/grpo1-copy-mb$mb.json" | s
        timeout 200 python3 bench/scale.py "${common[@]}" --gpus 2,4 --micro-batch $mb --set fsdp=false \
            --results /tmp/g2.md --json "$OUT/grpo-repl-mb$mb.json" | s
    done
    ;;
repl16)  # issue 16 after diag16: fsdp=false is plain replication now (no FSDP2 hooks); same machine
    common=(--shape qwen0.5b --steps 3 --warmup 2 --keep-model /tmp/m05 --run-timeout 110)
    s() { grep -E "^\| (dpo|grpo)" | tail -4; }
    timeout 200 python3 bench/scale.py "${common[@]}" --algos dpo --gpus 1,2,4 --set fsdp=false \
        --results /tmp/a.md --json "$OUT/dpo-replicated.json" --log-dir "$OUT/logs" | s
    timeout 130 python3 bench/scale.py "${common[@]}" --algos dpo --gpus 2,4 \
        --results /tmp/b.md --json "$OUT/dpo-fsdp.json" --log-dir "$OUT/logs-fsdp" | s
    timeout 250 python3 bench/scale.py "${common[@]}" --algos grpo --gpus 1,2,4 --set fsdp=false \
        --results /tmp/c.md --json "$OUT/grpo-replicated.json" --log-dir "$OUT/logs" | s
    ;;
trace16)
    common=(--shape qwen0.5b --steps 3 --warmup 2 --keep-model /tmp/m05 --run-timeout 90)
    for mb in 8 16; do
        timeout 120 python3 bench/scale.py "${common[@]}" --algos dpo --gpus 2 --micro-batch $mb \
            --trace /tmp/tr$mb --results /tmp/tr.md 2>&1 | grep -E "^\| dpo" | tail -1
        python3 bench/trace_skew.py /tmp/tr$mb/dpo2-rank0.json.gz /tmp/tr$mb/dpo2-rank1.json.gz | tee "$OUT/skew-mb$mb.txt"
    done
    timeout 170 python3 bench/scale.py "${common[@]}" --algos dpo --gpus 1,2,4 --micro-batch 16 --grad-ckpt false \
        --results "$OUT/dpo-mb16-nockpt.md" --json "$OUT/dpo-mb16-nockpt.json" 2>&1 | grep -E "^\| dpo|rror" | tail -4
    timeout 240 python3 bench/scale.py "${common[@]}" --algos grpo --gpus 1,2,4 \
        --results "$OUT/grpo.md" --json "$OUT/grpo.json" 2>&1 | grep -E "^\| grpo|rror" | tail -4
    ;;
async3)
    [ -f /tmp/arith/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/arith
    mkdir -p /tmp/rl
    common=(--data /tmp/arith --budget 100000 --eval-every 50 --set optim.max_steps=$STEPS --set rollout.sampler_copy=true)
    (for s in 0 1 2; do rl 0 copy-sync-s$s "${common[@]}" --seed $s; done) &
    (for s in 0 1 2; do rl 1,2 copy-disagg1-s$s "${common[@]}" --seed $s --nproc 2 \
        --set queue.placement=disaggregated --set queue.max_staleness=1; done) &
    (for c in none tis; do rl 3 copy-inter4-$c-s0 "${common[@]}" --seed 0 --set queue.placement=interleaved \
        --set queue.max_staleness=4 --set grpo.is_correction=$c; done) &
    wait
    (cd /tmp/rl && tar czf "$OUT/rl-async3.tgz" --exclude='*.safetensors' --exclude='checkpoints' .)
    ;;
entropy)
    [ -f /tmp/arith/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/arith
    mkdir -p /tmp/rl
    common=(--data /tmp/arith --budget "${1:-270}" --eval-every 25)
    rl 0 ent-copy-s0 "${common[@]}" --seed 0 --set rollout.sampler_copy=true &
    rl 1 ent-copy-s1 "${common[@]}" --seed 1 --set rollout.sampler_copy=true &
    rl 2 ent-torchhead-s0 "${common[@]}" --seed 0 --no-head-kernels &
    rl 3 ent-torchhead-s1 "${common[@]}" --seed 1 --no-head-kernels &
    wait
    (cd /tmp/rl && tar czf "$OUT/rl-entropy.tgz" --exclude='*.safetensors' --exclude='checkpoints' .)
    ;;
esac
