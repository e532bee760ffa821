#!/usr/bin/env bash
# Session 11's GPU calls (issues 16, 17, 19), one mode per device call (4 GPUs):
#   part <k>    append GGUF part k (bench/gguf_to_gpu.sh; carry the part, part 0 also the gguf
#               wheel), then one profiling job of issue 16 while the machine is held anyway:
#               k=0: DPO 1 and 2 GPUs; k=1: GRPO 1 and 2 GPUs; k=2: DPO 2 GPUs with fsdp=false
#               and with fsdp_reshard=false (bench/scale.py --profile: rank 0's op tables)
#   join <k>    only append GGUF part k (a fresh machine: three calls before the runs)
#   estimators  issue 17 §4: rloo, dr_grpo, reinforce_pp, ppo on the real model, one GPU each,
#               the GRPO recipe of session 10, --budget seconds of training
#   async       issue 19 §1: GPU 0 the synchronous loop, GPUs 1-2 disaggregated (1 trainer + 1
#               sampler, staleness 1), seeds 0,1,2 one after another, STEPS steps each; GPU 3:
#               interleaved staleness 4 with is_correction none / tis / mis (seed 0), and a GSM8K
#               GRPO run beside them (report only: issue 17 §4)
#   estimators2 <budget>  (next session) the β2-matched comparison: GPU 0 tether grpo, 1 TRL grpo,
#               2 tether rloo, 3 tether dr_grpo (seed 0); estimators3: reinforce_pp, ppo, TRL seed 1,
#               tether grpo seed 1
#   async2      (next session) GPUs 0-2: 1 trainer + 2 samplers (sampler_ranks=2, staleness 1),
#               GPU 3: the synchronous loop with model.head_fp32 (does the mismatch shrink?), then
#               interleaved staleness 4 + TIS with head_fp32
# Everything it writes goes under $OUT (one archive per mode: the device returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 SIZE=98362432
STEPS=${STEPS:-150}
mode=$1; shift

scale() {  # profile one scale.py configuration: scale <algo> <gpus> [--set k=v ...]
    local algo=$1 gpus=$2; shift 2
    timeout 200 python3 bench/scale.py --shape qwen0.5b --gpus "$gpus" --algos "$algo" --steps 3 --warmup 2 \
        --keep-model /tmp/m05 --profile "$OUT/prof" --results "$OUT/scale.md" --run-timeout 150 \
        --log-dir /tmp/scale-logs "$@" 2>&1 | grep -E "^\| (dpo|grpo)|×|error" | tail -6
}

rl() {  # rl <gpu(s)> <name> [real_model_rl.py args...]: one tether run in the background
    local gpus=$1 name=$2; shift 2
    CUDA_VISIBLE_DEVICES=$gpus python3 bench/real_model_rl.py tether --model /tmp/smollm2 --out "/tmp/rl/$name" \
        --recipe lr1e5_g16 "$@" > "/tmp/rl/$name.log" 2>&1
}

archive() {  # the small files of every run under /tmp/rl into $OUT/rl-<mode>.tgz, a line per curve
    (cd /tmp/rl && find . -maxdepth 3 \( -name curve.json -o -name config.yaml -o -name metrics.jsonl \
        -o -name '*.log' \) -print0 | tar czf "$OUT/rl-$1.tgz" --null -T -)
    for d in /tmp/rl/*/; do
        python3 -c "
import json; c=json.load(open('$d/curve.json')); p=c['points']
print('$(basename "$d")', c.get('returncode'), [(x['step'], round(x['train_seconds']), round(x['pass@1'],3)) for x in p])" \
            2>/dev/null || echo "$(basename "$d"): no curve"
    done
}

case "$mode" in
join)
    bash bench/gguf_to_gpu.sh join bench/gguf_parts/smollm2.gguf.part-0$1 $SHA $SIZE /tmp/gguf-0.19.0-py3-none-any.whl 2>&1 | tail -2
    ;;
part)
    k=$1
    bash bench/gguf_to_gpu.sh join bench/gguf_parts/smollm2.gguf.part-0$k $SHA $SIZE /tmp/gguf-0.19.0-py3-none-any.whl 2>&1 | tail -2
    case "$k" in
    0) scale dpo 1,2 ;;
    1) scale grpo 1,2 ;;
    2) scale dpo 2 --set fsdp=false; scale dpo 2 --set fsdp_reshard=false ;;
    esac
    tar czf "$OUT/prof-$k.tgz" -C "$OUT" prof scale.md -C /tmp scale-logs 2>/dev/null; rm -rf "$OUT/prof"
    ;;
estimators)
    budget=$1
    [ -f /tmp/arith/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/arith
    mkdir -p /tmp/rl
    common=(--data /tmp/arith --seed 0 --budget "$budget" --eval-every 25)
    rl 0 rloo-s0 "${common[@]}" --command rloo &
    rl 1 dr_grpo-s0 "${common[@]}" --set grpo.advantage=dr_grpo --set grpo.loss_agg=seq-mean-token-sum-norm &
    rl 2 reinforce_pp-s0 "${common[@]}" --set grpo.advantage=reinforce_pp &
    rl 3 ppo-s0 "${common[@]}" --command ppo --recipe ppo &
    wait
    archive estimators
    ;;
estimators2|estimators3)
    budget=$1
    [ -f /tmp/arith/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/arith
    mkdir -p /tmp/rl
    common=(--data /tmp/arith --budget "$budget" --eval-every 25)
    trl() { CUDA_VISIBLE_DEVICES=$1 python3 bench/real_model_rl.py trl --model /tmp/smollm2 --out "/tmp/rl/$2" \
        --recipe lr1e5_g16 "${@:3}" > "/tmp/rl/$2.log" 2>&1; }
    if [ "$mode" = estimators2 ]; then
        rl 0 b2-grpo-s0 "${common[@]}" --seed 0 &
        trl 1 b2-trl-s0 "${common[@]}" --seed 0 &
        rl 2 b2-rloo-s0 "${common[@]}" --seed 0 --command rloo &
        rl 3 b2-dr_grpo-s0 "${common[@]}" --seed 0 --set grpo.advantage=dr_grpo --set grpo.loss_agg=seq-mean-token-sum-norm &
    else
        rl 0 b2-reinforce_pp-s0 "${common[@]}" --seed 0 --set grpo.advantage=reinforce_pp &
        rl 1 b2-ppo-s0 "${common[@]}" --seed 0 --command ppo --recipe ppo &
        trl 2 b2-trl-s1 "${common[@]}" --seed 1 &
        rl 3 b2-grpo-s1 "${common[@]}" --seed 1 &
    fi
    wait
    archive "$mode"
    ;;
async2)
    [ -f /tmp/arith/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/arith
    mkdir -p /tmp/rl
    common=(--data /tmp/arith --budget 100000 --eval-every 50 --set optim.max_steps=$STEPS --seed 0)
    rl 0,1,2 disagg2-s0 "${common[@]}" --nproc 3 --set queue.placement=disaggregated \
        --set queue.max_staleness=1 --set queue.sampler_ranks=2 &
    (rl 3 sync-head32-s0 "${common[@]}" --set model.head_fp32=true
     rl 3 inter4-tis-head32-s0 "${common[@]}" --set model.head_fp32=true --set queue.placement=interleaved \
        --set queue.max_staleness=4 --set grpo.is_correction=tis) &
    wait
    archive async2
    ;;
async)
    [ -f /tmp/arith/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/arith
    [ -f /tmp/gsm8k/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/gsm8k --gsm8k bench/gsm8k
    mkdir -p /tmp/rl
    common=(--data /tmp/arith --budget 100000 --eval-every 50 --set optim.max_steps=$STEPS)
    (for s in 0 1 2; do rl 0 sync-s$s "${common[@]}" --seed $s; done) &
    (for s in 0 1 2; do rl 1,2 disagg1-s$s "${common[@]}" --seed $s --nproc 2 \
        --set queue.placement=disaggregated --set queue.max_staleness=1; done) &
    (for c in none tis mis; do rl 3 inter4-$c-s0 "${common[@]}" --seed 0 --set queue.placement=interleaved \
        --set queue.max_staleness=4 --set grpo.is_correction=$c; done) &
    [ "${GSM8K_BUDGET:-300}" = 0 ] || rl 3 gsm8k-s0 --data /tmp/gsm8k --seed 0 --budget "${GSM8K_BUDGET:-300}" \
        --eval-every 50 --set rollout.max_new_tokens=256 &
    wait
    archive async
    ;;
esac
