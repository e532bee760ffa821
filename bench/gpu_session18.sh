#!/usr/bin/env bash
# GPU calls planned after session 17 (4 x H100/H200 lease unless said). Session 17 measured FSDP2
# with its bf16 policy at last; after the calls four things changed that only a GPU can measure:
#   - the chunked LM head's vocabulary chunks are whole multiples of 128 columns (the 7B DPO trace
#     had 39 ms a step of align-1 GEMMs from 16,303-column chunks);
#   - setup no longer keeps the whole fp32 model on every GPU through sharding (7B DPO's 35.5 GiB and
#     the released 7B GRPO's 49.6 GiB peaks were that setup moment);
#   - the sampling copy is cast parameter by parameter on its way to the GPU;
#   - bench/scale.py's one-GPU GRPO samples from a bf16 copy (a fair baseline for the speed-ups).
# Modes, one per call:
#   smokelora  LoRA under FSDP2 on 2 GPUs (grpo with beta > 0, dpo): ~20 s, beside any other mode
#   like7b   7B DPO vs TRL 1.16, bf16 reduce on both, then a traced step (no cutlass align1 GEMM
#            should remain) -- gpu_session17.sh like7b. Carry wheels/.
#   like7bc  the same 7B DPO with model.compile=true (per-layer compile under FSDP2): the lever left
#            for the 1.3x target once the align fix is in (0.5B DPO: 1.46x from compile, session 14)
#   grpo7b   7B GRPO default and release_replica=true (expect ~38 GiB released, vs TRL's 41.1)
#   grpo05   0.5B GRPO weak scaling 1/2/4 with the fair one-GPU baseline, and DPO 1/2/4 beside it
#   mem7b    memory_check: 7B DPO on 4 (its training peak, setup apart) and 7B SFT on 4; after like7b
#            or grpo7b on the same warm machine (it links their /tmp/m7 weights)
# Session 18 ran them as two calls, callA (smokelora, like7b, like7bc) and callB (grpo7b released, mem7b,
# grpo05); the async runs (its callC, never reached) are bench/gpu_session19.sh callC now.
# and, through `bash bench/gpu_session16.sh MODE`: async5a (3 seeds; needs the SmolLM2 parts: join 0/1/2
# first), async5b.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mode=$1; shift

case "$mode" in
smokelora)  # LoRA under FSDP2 on CUDA (grpo with a KL term, dpo): session 16's fix, CPU-tested only
    CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 bench/gpu_smoke.py --nproc 2 --only grpo-lora,dpo-lora --out "$OUT/smokelora.json"
    ;;
like7b)
    bash bench/gpu_session17.sh like7b
    ;;
like7bc)  # ours with model.compile=true (per-layer compile under FSDP2; runs on CPU gloo), after like7b
    timeout 400 python3 bench/scale.py --shape qwen7b --gpus 4 --algos dpo --steps 5 --warmup 3 --keep-model /tmp/m7 \
        --run-timeout 380 --set fsdp_reduce=bf16 --set compile=true --results "$OUT/like7bc.md" \
        --json "$OUT/like7bc.json" 2>&1 | grep -E "^\| dpo"
    ;;
grpo7b)
    bash bench/gpu_session16.sh grpo7b
    ;;
grpo05)
    timeout 330 python3 bench/scale.py --shape qwen0.5b --gpus 1,2,4 --algos grpo --steps 4 --warmup 2 --keep-model /tmp/m05 \
        --run-timeout 110 --results "$OUT/grpo05.md" --json "$OUT/grpo05.json" 2>&1 | grep -E "^\| grpo"
    timeout 240 python3 bench/scale.py --shape qwen0.5b --gpus 1,2,4 --algos dpo --steps 5 --warmup 2 --keep-model /tmp/m05 \
        --run-timeout 80 --results "$OUT/dpo05.md" --json "$OUT/dpo05.json" 2>&1 | grep -E "^\| dpo"
    ;;
mem7b)
    S=(--shape qwen2.5-7b --steps 2 --gradient-checkpointing --weights-from /tmp/m7)
    CUDA_VISIBLE_DEVICES=0,1,2,3 timeout 280 python3 -m torch.distributed.run --nproc-per-node 4 --master-port 29750 \
        bench/memory_check.py --device cuda --out "$OUT/mem-dpo7b.jsonl" "${S[@]}" --workdir /tmp/mc7 --algo dpo \
        --batch-size 2 --grad-accum 4 --seq-len 1024 > "$OUT/mc-dpo7b.log" 2>&1; echo "dpo7b rc=$?"
    CUDA_VISIBLE_DEVICES=0,1,2,3 timeout 280 python3 -m torch.distributed.run --nproc-per-node 4 --master-port 29751 \
        bench/memory_check.py --device cuda --out "$OUT/mem-sft7b.jsonl" "${S[@]}" --workdir /tmp/mc7 --algo sft \
        --batch-size 2 --grad-accum 4 --seq-len 1024 > "$OUT/mc-sft7b.log" 2>&1; echo "sft7b rc=$?"
    cat "$OUT"/mem-*.jsonl
    ;;
callA)  # first call: GGUF part 0 (and the TRL wheels), smokelora beside nothing, like7b, like7bc
    bash bench/gpu_session16.sh join 0
    bash "$0" smokelora; python3 -c "import json; [print(r) for r in json.load(open('$OUT/smokelora.json'))]" 2>&1 | cut -c1-300
    bash "$0" like7b; rm -f "$OUT"/*.gz  # (the raw trace: at most 8 files come back)
    timeout $((585 - SECONDS)) bash "$0" like7bc  # (the call's 600 s)
    ;;
callB)  # second call: part 1, released 7B GRPO, 7B DPO training peak, 0.5B scaling (fair GRPO baseline;
        # DPO replicated + compiled: the configuration the setup hint recommends at this size)
    bash bench/gpu_session16.sh join 1
    timeout 200 python3 bench/scale.py --shape qwen7b --gpus 4 --algos grpo --steps 2 --warmup 1 --keep-model /tmp/m7 \
        --run-timeout 180 --set release_replica=true --results "$OUT/grpo7b.md" --json "$OUT/grpo7b-release.json" 2>&1 | grep -E "^\| grpo"
    S=(--shape qwen2.5-7b --steps 2 --gradient-checkpointing --weights-from /tmp/m7)
    CUDA_VISIBLE_DEVICES=0,1,2,3 timeout 150 python3 -m torch.distributed.run --nproc-per-node 4 --master-port 29750 \
        bench/memory_check.py --device cuda --out "$OUT/mem-dpo7b.jsonl" "${S[@]}" --workdir /tmp/mc7 --algo dpo \
        --batch-size 2 --grad-accum 4 --seq-len 1024 > /tmp/mc-dpo7b.log 2>&1; echo "dpo7b rc=$?"; cat "$OUT/mem-dpo7b.jsonl"
    timeout 170 python3 bench/scale.py --shape qwen0.5b --gpus 1,2,4 --algos grpo --steps 4 --warmup 2 --keep-model /tmp/m05 \
        --run-timeout 60 --results "$OUT/grpo05.md" --json "$OUT/grpo05.json" 2>&1 | grep -E "^\| grpo"
    timeout 170 python3 bench/scale.py --shape qwen0.5b --gpus 1,2,4 --algos dpo --steps 5 --warmup 3 --keep-model /tmp/m05 \
        --run-timeout 55 --set fsdp=false --set compile=true --results "$OUT/dpo05c.md" --json "$OUT/dpo05c.json" 2>&1 | grep -E "^\| dpo"
    ;;
*)
    echo "unknown mode $mode (smokelora, like7b, like7bc, grpo7b, grpo05, mem7b; async ones: bench/gpu_session16.sh)" >&2; exit 2
    ;;
esac
