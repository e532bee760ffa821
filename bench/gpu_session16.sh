#!/usr/bin/env bash
# GPU calls planned after session 15 (one mode per device call; the GGUF parts travel one per call
# with `join 0/1/2`, as in bench/gpu_session14.sh; `join 0` also installs TRL's wheels when carried):
#   tests    the GPU tests, first: tests/test_rollout_gpu.py (two Samplers, one released: the other's
#            graphs intact — pytorch#193402, the likely cause of session 15's wrong interleaved eval
#            points) and tests/test_online_gpu.py (every interleaved eval point = a fresh evaluation)
#   evalfix  (after join) session 15's evalbug A and B again with the fixes: logged eval vs `tether eval`
#   async5a  (after join) issue 19 §1 cleanly: synchronous and disaggregated 1+1 (staleness 1),
#            model.compile=true + rollout.sampler_copy=true, 3 seeds, ONE RUN AT A TIME (session 15
#            ran three groups at once on one host); the sampler's cycle is logged now
#            (queue/weights_wait|produce|send_seconds)
#   async5b  (after join) interleaved staleness 4, none / tis / mis, one GPU each, with evaluation fixed
#   grpo7b   issue 16: 7B GRPO at TRL's memory? rollout.release_replica=true (the replica and KV cache
#            freed for each update, graphs recaptured) vs the default, on 4 GPUs (session 13: 63.7 GiB
#            allocated vs TRL 41.1)
#   trace7b  issue 16: tether's 7B DPO step traced with shapes (which tensors the ~100 ms of casts
#            and copies move; scale.py --trace records shapes now)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mode=$1; shift

rl() {  # rl <gpus> <name> args...: one real-model GRPO run (bench/real_model_rl.py)
    local gpus=$1 name=$2; shift 2
    CUDA_VISIBLE_DEVICES=$gpus python3 bench/real_model_rl.py tether --model /tmp/smollm2 --out "/tmp/rl/$name" \
        --recipe lr1e5_g16 --data /tmp/arith --budget 100000 --seed "${SEED:-0}" "$@" > "/tmp/rl/$name.log" 2>&1
}
prep() { [ -f /tmp/arith/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/arith; mkdir -p /tmp/rl; }
common=(--eval-every 50 --set optim.max_steps=${STEPS:-100} --set rollout.sampler_copy=true --set model.compile=true)

case "$mode" in
join)
    bash bench/gpu_session11.sh join "$1" 2>&1 | tail -1
    [ "$1" = 0 ] && ls wheels/*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps wheels/*.whl 2>&1 | tail -2
    ;;
tests)
    [ -n "${JOIN0:-}" ] && bash "$0" join 0  # (with JOIN0=1: the first GGUF part travels in the same call)
    python3 -m pytest -q -m gpu tests/test_rollout_gpu.py tests/test_online_gpu.py -p no:cacheprovider 2>&1 | tail -15
    echo "== without the fix (one shared capture stream): the regression test should fail"
    PYTHONPATH=$PWD:$PWD/bench python3 -m pytest -q -m gpu -p nofix_capture_stream -p no:cacheprovider \
        tests/test_rollout_gpu.py -k "released or streams" 2>&1 | tail -4
    ;;
evalfix)
    RUNS="A B" bash bench/gpu_session15.sh evalbug
    ;;
evaldiag)  # (after join) the wrong eval points scored four ways (bench/evaldiag.py): copy / no copy
    prep
    python3 bench/evaldiag.py --model /tmp/smollm2 --data /tmp/arith --out /tmp/diag/copy > /tmp/diag-copy.log 2>&1 &
    python3 bench/evaldiag.py --model /tmp/smollm2 --data /tmp/arith --out /tmp/diag/nocopy \
        --set rollout.sampler_copy=false > /tmp/diag-nocopy.log 2>&1 &
    wait
    for v in copy nocopy; do echo "== $v"; grep -E "^DIAG|Error|error" /tmp/diag-$v.log | tail -4; done
    cp /tmp/diag-*.log "$OUT/"
    ;;
evalinter)  # one call on a 4-GPU lease: evalfix on GPU 0 beside async5b on GPUs 1-3 (neither is timed)
    CUDA_VISIBLE_DEVICES=0 RUNS="A B" bash bench/gpu_session15.sh evalbug > /tmp/evalfix.txt 2>&1 &
    G0=1 bash "$0" async5b
    wait
    cat /tmp/evalfix.txt
    ;;
async5a)
    prep
    for s in ${SEEDS:-0 1 2}; do  # (SEEDS="0 1" then SEEDS=2 if one call's 10 minutes are too few)
        SEED=$s rl 0 c-sync-s$s "${common[@]}"
        SEED=$s rl 0,1 c-disagg1-s$s "${common[@]}" --nproc 2 --set queue.placement=disaggregated \
            --set queue.max_staleness=1
    done
    (cd /tmp/rl && tar czf "$OUT/rl-async5a.tgz" --exclude='checkpoints' .)
    ;;
async5b)
    prep
    g=${G0:-0}  # the first of three GPUs
    for c in none tis mis; do
        rl $g c-inter4-$c-s0 "${common[@]}" --set queue.placement=interleaved --set queue.max_staleness=4 \
            --set grpo.is_correction=$c &
        g=$((g + 1))
    done
    wait
    (cd /tmp/rl && tar czf "$OUT/rl-async5b.tgz" --exclude='checkpoints' .)
    ;;
grpo7b)
    for set in "" "--set release_replica=true"; do
        timeout 280 python3 bench/scale.py --shape qwen7b --gpus 4 --algos grpo --steps 2 --warmup 1 --keep-model /tmp/m7 \
            --run-timeout 260 $set --results "$OUT/grpo7b.md" --json "$OUT/grpo7b${set:+-release}.json" 2>&1 | grep -E "^\| grpo"
    done
    ;;
trace7b)
    timeout 200 python3 bench/scale.py --shape qwen7b --gpus 4 --algos dpo --steps 2 --warmup 2 --keep-model /tmp/m7 \
        --run-timeout 180 --set fsdp_reduce=bf16 --trace /tmp/t7 --results /tmp/t7.md > /dev/null 2>&1
    (cd bench && python3 trace_busy.py /tmp/t7/*rank0*.gz) | tee "$OUT/trace7b-busy.txt"
    cp /tmp/t7/*rank0*.gz "$OUT/" 2>/dev/null
    ;;
esac
