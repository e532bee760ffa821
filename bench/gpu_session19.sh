#!/usr/bin/env bash
# GPU calls of session 19 (a 2-GPU lease: issue 19 §1 names 2 GPUs; idle release is 30 s: chain the
# calls). The GGUF fixture travels in three parts, one a call (bench/gguf_to_gpu.sh), so the first
# two calls carry a part and do short work; the real-model runs start with the third.
#   callA  GGUF part 0: the queue over NCCL with a tiny model (bench/gpu_smoke.py grpo-disagg: the
#          sampler receives each next version while it produces a batch, online_disaggregated.Incoming)
#   callB  GGUF part 1: the GPU tests (tests/test_rollout_gpu.py, tests/test_online_gpu.py)
#   callC  GGUF part 2 (the model converts): async5a seeds 0 1 — synchronous on GPU 0, then
#          disaggregated 1 + 1 at staleness 1 on GPUs 0+1, one run at a time (session 16's recipe)
#   callD  async5a seed 2, then disaggregated + TIS (token, cap 2) seeds 0 1 2 as time allows: does
#          the correction close staleness 1's held-out pass@1 gap (session 16: lower on every seed)?
# Every call ends with bench/async_summary.py over the runs so far ($OUT/async-summary.md/.json).
# (Session 18's plan for this file, issue 16's 7B follow-ups on 4 GPUs, is in git history: 4542bdf.)
# As run in session 19: lease 1 = callA, then only `bash bench/gpu_session16.sh join 1` (the GPU
# tests did not fit the device time), callC, callD (commit c98c855); lease 2 (after e88c4d1) =
# `join 0`, `join 1`, `TORCH_LOGS=recompiles DEADLINE=560 callC`, then `SEEDS=2 bash
# bench/gpu_session16.sh async5a` — RESULTS.md "Session 19".
source "$(dirname "$0")/capped.sh"  # capped SECONDS cmd...; strict mode, cd to the root, PYTHONPATH, $OUT
mode=$1; shift
summary() {
    python3 bench/async_summary.py /tmp/rl/c-* --json "$OUT/async-summary.json" > "$OUT/async-summary.md" 2>&1
    cat "$OUT/async-summary.md"
    (cd /tmp/rl && tar czf "$OUT/rl-s19.tgz" --exclude='checkpoints' .)
}
end=$((SECONDS + ${DEADLINE:-570}))
seed_runs() {  # seed_runs <kind> <seeds...>: each run only if 150 s are left
    local kind=$1; shift
    for s in "$@"; do
        [ $((end - SECONDS)) -lt 150 ] && { echo "no time for $kind seed $s"; break; }
        case "$kind" in
        pair) SEEDS=$s capped $((end - SECONDS)) bash bench/gpu_session16.sh async5a > /dev/null 2>&1 ;;
        tis)  CUDA_VISIBLE_DEVICES=0,1 capped $((end - SECONDS)) python3 bench/real_model_rl.py tether --model /tmp/smollm2 \
                  --out /tmp/rl/c-disagg1tis-s$s --recipe lr1e5_g16 --data /tmp/arith --budget 100000 --seed $s \
                  --eval-every 50 --set optim.max_steps=100 --set rollout.sampler_copy=true --set model.compile=true \
                  --nproc 2 --set queue.placement=disaggregated --set queue.max_staleness=1 \
                  --set grpo.is_correction=tis --set grpo.is_cap=2 > /tmp/rl/c-disagg1tis-s$s.log 2>&1 ;;
        esac
        echo "$kind seed $s rc=$? at ${SECONDS}s"
    done
}

case "$mode" in
callA)
    bash bench/gpu_session16.sh join 0
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    capped 200 python3 bench/gpu_smoke.py --nproc 2 --only grpo-disagg,grpo --timeout 150 --out "$OUT/smoke.jsonl"
    ;;
callB)
    bash bench/gpu_session16.sh join 1
    capped 400 python3 -m pytest -q -m gpu tests/test_rollout_gpu.py tests/test_online_gpu.py -p no:cacheprovider 2>&1 | tail -8
    ;;
callC)
    bash bench/gpu_session16.sh join 2
    [ -d /tmp/smollm2 ] || { echo "no /tmp/smollm2: the GGUF parts did not all arrive"; exit 1; }
    seed_runs pair 0 1
    summary
    ;;
callD)
    seed_runs pair 2
    seed_runs tis 0 1 2
    summary
    ;;
*)
    echo "unknown mode $mode (callA, callB, callC, callD)" >&2; exit 2
    ;;
esac
