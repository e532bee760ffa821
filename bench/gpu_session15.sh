#!/usr/bin/env bash
# GPU calls planned after session 14 (one mode per device call, a 4-GPU machine held across them;
# the GGUF parts travel one per call with the first three, as in bench/gpu_session14.sh):
#   like7b   issue 16: 7B-shape DPO on 4 GPUs like with like — tether fsdp_reduce=bf16 vs TRL's default
#            (bf16 reduction), then tether's default vs TRL with --trl-reduce fp32; one machine
#   grpo4tr  issue 16: GRPO fsdp=false on 1 and 4 GPUs traced (why 4 GPUs add ~0.4-0.5 s a step
#            where 2 add none: bench/trace_busy.py on rank 0 of each)
#   async4   issue 19 §1 (after join 0/1/2): the queue with model.compile=true on both sides (the
#            trainer-bound disaggregated step: session 14 measured 0.66x, floor = the training part)
#            GPU 0 synchronous, GPUs 1-2 disaggregated, seeds 0-2; GPU 3 interleaved staleness 4
#            none / tis / mis with evaluation fixed (seed 0)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mode=$1; shift

case "$mode" in
join)  # join <k>: as bench/gpu_session14.sh (part 0 also installs TRL's wheels)
    bash bench/gpu_session11.sh join "$1" 2>&1 | tail -1
    [ "$1" = 0 ] && python3 -m pip install -q --no-index --no-deps wheels/*.whl 2>&1 | tail -2
    ;;
like7b)
    python3 -m pip install -q --no-index --no-deps wheels/*.whl 2>&1 | tail -1
    common=(--shape qwen7b --gpus 4 --algos dpo --steps 5 --warmup 2 --keep-model /tmp/m7 --run-timeout 200
            --trl-timeout 280)
    timeout 330 python3 bench/scale.py "${common[@]}" --trl --set fsdp_reduce=bf16 --results "$OUT/like7b-bf16.md" \
        --json "$OUT/like7b-bf16.json" 2>&1 | grep -E "^\| (dpo|TRL)" | cut -c1-300
    timeout 260 python3 bench/scale.py "${common[@]}" --trl --trl-reduce fp32 --results "$OUT/like7b-fp32.md" \
        --json "$OUT/like7b-fp32.json" --log-dir "$OUT/logs-fp32" 2>&1 | grep -E "^\| (dpo|TRL)" | cut -c1-300
    grep -h "FSDP2 policy" "$OUT"/logs-fp32/*.log | head -1
    # where tether's 7B step goes (bf16 reduction): 2 traced steps, rank 0's busy table
    timeout 150 python3 bench/scale.py "${common[@]}" --set fsdp_reduce=bf16 --trace /tmp/t7 \
        --results /tmp/t7.md > /dev/null 2>&1
    (cd bench && python3 trace_busy.py /tmp/t7/*rank0*.gz) > "$OUT/like7b-busy.txt" 2>&1; head -30 "$OUT/like7b-busy.txt"
    cp /tmp/t7/*rank0*.gz "$OUT/" 2>/dev/null
    ;;
grpo4tr)
    common=(--shape qwen0.5b --steps 3 --warmup 2 --keep-model /tmp/m05 --run-timeout 110 --algos grpo)
    timeout 120 python3 bench/scale.py "${common[@]}" --gpus 1 --set rollout.sampler_copy=true --trace /tmp/t1 \
        --results /tmp/g1.md | grep -E "^\| grpo" | tail -1
    timeout 150 python3 bench/scale.py "${common[@]}" --gpus 4 --set fsdp=false --trace /tmp/t4 \
        --results /tmp/g4.md | grep -E "^\| grpo" | tail -1
    (cd bench && python3 trace_busy.py /tmp/t1/*rank0*.gz /tmp/t4/*rank0*.gz) | tee "$OUT/grpo4-busy.txt"
    (cd bench && python3 trace_skew.py /tmp/t4/grpo4*-rank{0,1,2,3}.json.gz) | tee "$OUT/grpo4-skew.txt" | head -40
    tar czf "$OUT/grpo4-traces.tgz" -C /tmp t1 t4
    ;;
async4)
    [ -f /tmp/arith/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/arith
    mkdir -p /tmp/rl
    rl() {
        local gpus=$1 name=$2; shift 2
        CUDA_VISIBLE_DEVICES=$gpus python3 bench/real_model_rl.py tether --model /tmp/smollm2 --out "/tmp/rl/$name" \
            --recipe lr1e5_g16 "$@" > "/tmp/rl/$name.log" 2>&1
    }
    common=(--data /tmp/arith --budget 100000 --eval-every 50 --set optim.max_steps=${STEPS:-100}
            --set rollout.sampler_copy=true --set model.compile=true)
    (for s in 0 1 2; do rl 0 c-sync-s$s "${common[@]}" --seed $s; done) &
    (for s in 0 1 2; do rl 1,2 c-disagg1-s$s "${common[@]}" --seed $s --nproc 2 \
        --set queue.placement=disaggregated --set queue.max_staleness=1; done) &
    (for c in none tis mis; do rl 3 c-inter4-$c-s0 "${common[@]}" --seed 0 --set queue.placement=interleaved \
        --set queue.max_staleness=4 --set grpo.is_correction=$c; done) &
    wait
    (cd /tmp/rl && tar czf "$OUT/rl-async4.tgz" --exclude='*.safetensors' --exclude='checkpoints' .)
    ;;
evalbug)  # session 15: interleaved staleness 4's held-out pass@1 (0.07 / 0.185) far below its own
    # samples' reward (0.5, entropy 0.1): which of compile / the thread / the fp32 eval sampler; and
    # the final checkpoint evaluated by `tether eval` in a fresh process against the logged value
    [ -f /tmp/arith/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/arith
    mkdir -p /tmp/rl
    rl() {
        local name=$1; shift
        python3 bench/real_model_rl.py tether --model /tmp/smollm2 --out "/tmp/rl/$name" --recipe lr1e5_g16 \
            --data /tmp/arith --budget 100000 --eval-every 15 --set optim.max_steps=${STEPS:-30} --seed 0 "$@" \
            > "/tmp/rl/$name.log" 2>&1
    }
    inter=(--set queue.placement=interleaved --set queue.max_staleness=4)
    runs=${RUNS:-A B C D}  # after the fix (Interleaved.alone / graphs.CAPTURE_LOCK): RUNS="A B"
    [[ $runs == *A* ]] && rl A-inter-compile-copy "${inter[@]}" --set model.compile=true --set rollout.sampler_copy=true &
    [[ $runs == *B* ]] && rl B-inter-copy "${inter[@]}" --set rollout.sampler_copy=true &
    [[ $runs == *C* ]] && rl C-sync-compile --set model.compile=true &
    [[ $runs == *D* ]] && rl D-inter-compile "${inter[@]}" --set model.compile=true &
    wait
    for n in A-inter-compile-copy B-inter-copy C-sync-compile D-inter-compile; do
        [ -d /tmp/rl/$n ] || continue
        ck=$(ls -d /tmp/rl/$n/run/checkpoints/step-* 2>/dev/null | sort -t- -k2 -n | tail -1)
        echo "== $n logged: $(grep -h pass@1 /tmp/rl/$n/run/metrics.jsonl | python3 -c "import sys,json;print([(json.loads(l)['step'],json.loads(l)['eval/greedy/pass@1']) for l in sys.stdin])")"
        [ -n "$ck" ] && python3 -m tether eval model.path=$ck data.path=/tmp/arith/heldout.jsonl generation.decoding=greedy \
            "reward.reward_funcs=[math]" generation.max_new_tokens=96 2>&1 | grep -E "pass@1|greedy/reward " | head -2
    done
    (cd /tmp/rl && tar czf "$OUT/rl-evalbug.tgz" --exclude='checkpoints' .)
    ;;
esac
