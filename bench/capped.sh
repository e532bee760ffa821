# Sourced by bench/gpu_session*.sh (from session 21 on, after `source bench/capped.sh` it also sets
# what every one of them sets: strict mode, the repository root as the working directory,
# PYTHONPATH, OMP_NUM_THREADS and $OUT). capped SECONDS cmd... runs cmd in a process group of its own and
# kills the whole group past SECONDS (a plain `timeout` on torchrun left its ranks holding 11-17 GB
# on every GPU in session 18, which contaminated the runs after it).
capped() {
    local s=$1; shift
    setsid "$@" & local pid=$!
    ( sleep "$s"; kill -9 -- -"$pid" 2>/dev/null ) & local guard=$!
    wait "$pid"; local rc=$?
    kill "$guard" 2>/dev/null; kill -9 -- -"$pid" 2>/dev/null
    return $rc
}

set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
