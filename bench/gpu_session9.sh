#!/bin/bash
# Issue 16's GPU measurements (session 9, benchmarks/RESULTS.md "Session 9"), on a 4-GPU machine:
#   bash bench/gpu_session9.sh A [budget_s]   # 0.5B scaling 1/2/4 GPUs, memory planner (0.5B), fsdp_offload
#   bash bench/gpu_session9.sh B [budget_s]   # 7B shape on 4 GPUs: tether vs TRL 1.16 (GRPO, DPO), planner (7B)
# Logs and JSON under $OUT (or ./gpu-out). Every step has its own timeout inside the budget, most
# important first. B needs trl, datasets, dill, multiprocess importable (wheels/ -> PYTHONPATH).
set -x
stage=${1:?A or B}; budget=${2:-560}
OUT=${OUT:-$PWD/gpu-out}
T0=$(date +%s)
left() { echo $(( budget - ($(date +%s) - T0) )); }
cap() { local want=$1 l=$(( $(left) - ${2:-15} )); (( l < want )) && want=$l; (( want < 5 )) && want=5; echo $want; }
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false HF_DATASETS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# DEV=cpu PY=.venv/bin/python S05=tiny MC05=tiny S7=tiny MC7=tiny: the same commands on CPU (a dry run)
DEV=${DEV:-cuda}; PY=${PY:-python3}; S05=${S05:-qwen0.5b}; MC05=${MC05:-qwen2.5-0.5b}; S7=${S7:-qwen7b}; MC7=${MC7:-qwen2.5-7b}
[ "$DEV" = cpu ] && export TETHER_DIST_BACKEND=gloo
L=/tmp/s9logs; mkdir -p $L $OUT
nvidia-smi --query-gpu=index,name,memory.total,clocks.sm --format=csv | tee $L/machine.txt
$PY -c 'import torch, transformers, accelerate; print("torch", torch.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__, "gpus", torch.cuda.device_count())' | tee -a $L/machine.txt
date -u | tee -a $L/machine.txt

# memory_check: mc TAG NPROC DEVICES PORT TIMEOUT args...   (one line per run in $L/mem-TAG.jsonl)
mc() {
  local tag=$1 n=$2 dev=$3 port=$4 t=$5; shift 5
  local run="$PY"
  [ "$n" -gt 1 ] && run="$PY -m torch.distributed.run --nproc-per-node $n --master-port $port"
  CUDA_VISIBLE_DEVICES=$dev timeout $(cap $t) $run bench/memory_check.py --device $DEV --out $L/mem-$tag.jsonl "$@" > $L/mc-$tag.log 2>&1
  echo "mc $tag rc=$? left=$(left)"
}

if [ "$stage" = A ]; then
  # 1. scaling, Qwen2.5-0.5B shape, 1/2/4 GPUs, GRPO + DPO (weak scaling), 5 steps after 2 warm-up
  timeout $(cap 330 200) $PY bench/scale.py --device $DEV --shape $S05 --gpus 1,2,4 --algos grpo,dpo --steps 5 --warmup 2 \
      --run-timeout 110 --json $OUT/scale-05b.json --results $OUT/scale-05b.md --log-dir $L/runs 2>&1 | tee $OUT/scale-05b.out
  echo "scale done left=$(left)"
  # 2. memory planner, 0.5B, lanes on disjoint GPUs at once (peaks are per process); offload vs not
  S=(--shape $MC05 --steps 3)
  ( mc sft1 1 0 29710 100 "${S[@]}" --workdir /tmp/mcA --algo sft --batch-size 4 --grad-accum 4 --seq-len 1024
    mc ppo1 1 0 29711 100 "${S[@]}" --workdir /tmp/mcA --algo ppo --prompts 16 --generations 1 --prompt-len 128 --new-tokens 384 --minibatches 4 ) &
  ( mc grpo1 1 1 29720 100 "${S[@]}" --workdir /tmp/mcB --algo grpo --prompts 16 --generations 8 --prompt-len 128 --new-tokens 384 --micro-batch 16
    mc lora1 1 1 29721 100 "${S[@]}" --workdir /tmp/mcB --algo sft --batch-size 4 --grad-accum 4 --seq-len 1024 --lora-r 16 --gradient-checkpointing ) &
  ( mc dpo2 2 2,3 29730 100 "${S[@]}" --workdir /tmp/mcC --algo dpo --batch-size 2 --grad-accum 4 --seq-len 1024
    mc off2 2 2,3 29731 120 "${S[@]}" --workdir /tmp/mcC --algo sft --batch-size 4 --grad-accum 4 --seq-len 1024 --fsdp-offload
    mc sft2 2 2,3 29732 100 "${S[@]}" --workdir /tmp/mcC --algo sft --batch-size 4 --grad-accum 4 --seq-len 1024 ) &
  wait
  mc lora4 4 0,1,2,3 29740 100 "${S[@]}" --workdir /tmp/mcD --algo sft --batch-size 4 --grad-accum 4 --seq-len 1024 --lora-r 16
  mc ppo4 4 0,1,2,3 29741 100 "${S[@]}" --workdir /tmp/mcD --algo ppo --prompts 16 --generations 1 --prompt-len 128 --new-tokens 384 --minibatches 4 --gradient-checkpointing
fi

if [ "$stage" = B ]; then
  $PY -c 'import trl, datasets; print("trl", trl.__version__, "datasets", datasets.__version__)' | tee -a $L/machine.txt
  M=/tmp/m7; C=(--shape $S7 --gpus 4 --keep-model $M --log-dir $L/runs)
  # 1. tether GRPO 7B on 4 GPUs (8 prompts x 8 x (128 + 512)), builds the model once (bf16, on the GPU)
  timeout $(cap 230 200) $PY bench/scale.py --device $DEV "${C[@]}" --algos grpo --steps 3 --warmup 1 --run-timeout 200 \
      --json $OUT/scale-7b-grpo.json --results $OUT/scale-7b.md 2>&1 | tee $OUT/scale-7b.out
  echo "7b grpo done left=$(left)"
  # 2. tether DPO 7B (1024-token pairs), then TRL's DPO on the same model and data
  timeout $(cap 300 120) $PY bench/scale.py --device $DEV "${C[@]}" --algos dpo --steps 4 --warmup 1 --run-timeout 110 \
      --trl --trl-steps 3 --trl-warmup 1 --trl-timeout 170 --json $OUT/scale-7b-dpo.json --results $OUT/scale-7b.md 2>&1 | tee -a $OUT/scale-7b.out
  echo "7b dpo done left=$(left)"
  # 3. TRL GRPO 7B: one measured step, capped (HF generate under FSDP2)
  t=$(( $(left) - 110 )); (( t > 200 )) && t=200; (( t < 60 )) && t=60
  timeout $(( t + 20 )) $PY bench/scale.py --device $DEV "${C[@]}" --algos grpo --trl --trl-only --trl-steps 1 --trl-warmup 0 \
      --trl-timeout $t --json $OUT/scale-7b-trlgrpo.json --results $OUT/scale-7b.md 2>&1 | tee -a $OUT/scale-7b.out
  echo "trl grpo done left=$(left)"
  # 4. planner at 7B: SFT, 4 GPUs, checkpointing, 2 x 2048 tokens (the model's weights linked)
  mc sft7b4 4 0,1,2,3 29750 100 --shape $MC7 --steps 2 --workdir /tmp/mc7 --weights-from $M --algo sft \
      --batch-size 2 --grad-accum 4 --seq-len 2048 --gradient-checkpointing
fi
cat $L/mem-*.jsonl > $OUT/memory-$stage.jsonl 2>/dev/null
tar czf $OUT/logs-$stage.tgz -C /tmp s9logs
echo "end left=$(left)"
