#!/usr/bin/env bash
# One device call that checks and measures everything a session's GPU time is first spent on
# (run by the `device` tool from the repository root; see tests/gpu/README.md):
#
#   bash tests/gpu/session.sh [BASE_DIR]
#
# with `.whl/` holding the wheels the README names (carry it), and BASE_DIR (carry it too) an
# export of the code to compare with (`git archive BASE anynorm kernels asv_bench`), if any.
# Each step has its own time limit and a step that fails does not stop the next; after each
# step everything written so far is packed into $OUT/all.tgz (the tool brings back at most 8
# files), so a call cut short still returns what it measured. Steps, in order of what matters
# most: the GPU suite; the CPU suite's CUDA variants; gpu_report.py --sections rows,strided
# on BASE_DIR then on this tree; rows_fwd_lean against rows_fwd_block on the same rows
# (gpu_row_variants.py shipped,nolean); --sections overhead,e2e; the host profile of a training
# call; ncu instruction counts of the row kernels, forward and backward, with ncu's
# per-instruction CSVs kept (compressed) for a look at where the instructions go, and the
# backward's warp stall reasons and occupancy (ncu_bwd_details.txt).
R=/tmp/session; rm -rf "$R"; mkdir -p "$R"
BASE=${1:-}
snap() { tar czf "$OUT/all.tgz" -C "$R" . ; }
elapsed() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv > "$R/device.txt"; git log -1 --format=%H >> "$R/device.txt" 2>/dev/null
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)

timeout 150 python3 -m pytest -p no:cacheprovider -q -n 12 --timeout 120 -m gpu tests/gpu > "$R/gpu_suite.log" 2>&1
snap; elapsed suite; grep -E "^FAILED|passed|failed" "$R/gpu_suite.log" | tail -6
timeout 100 python3 -m pytest -p no:cacheprovider -q -n 12 --timeout 60 tests -k "cupy or torch-cuda" > "$R/cuda_backends.log" 2>&1
snap; elapsed backends; tail -1 "$R/cuda_backends.log"
if [ -n "$BASE" ]; then
    mkdir -p "$R/base"
    (cd "$BASE" && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 asv_bench/gpu_report.py --quick --budget-s 100 \
        --sections rows,strided --out "$R/base" > "$R/base.log" 2>&1)
    snap; elapsed base; tail -1 "$R/base.log"
fi
mkdir -p "$R/head" "$R/e2e"
timeout 120 python3 asv_bench/gpu_report.py --quick --budget-s 100 --sections rows,strided --out "$R/head" > "$R/head.log" 2>&1
snap; elapsed head; tail -1 "$R/head.log"
timeout 60 python3 asv_bench/gpu_row_variants.py --widths 512,1024,4096,16384 --rounds 3 \
    --variants shipped,nolean,stash16 > "$R/lean_ab.md" 2>&1
timeout 40 python3 asv_bench/gpu_row_variants.py --widths 1024,4096,16384 --dtypes bfloat16 --rounds 3 \
    --variants shipped,nolean --params float32 >> "$R/lean_ab.md" 2>&1
snap; elapsed lean; cat "$R/lean_ab.md"
timeout 130 python3 asv_bench/gpu_report.py --quick --budget-s 100 --sections overhead,e2e --out "$R/e2e" > "$R/e2e.log" 2>&1
snap; elapsed e2e; tail -1 "$R/e2e.log"
timeout 40 python3 asv_bench/gpu_host_profile.py --calls 1000 --rounds 3 > "$R/host_profile.txt" 2>&1
snap; elapsed host; sed -n 2,8p "$R/host_profile.txt"
for part in fwd bwd; do
    # the backward also with its warps' stall reasons: at ~50 instructions an element it
    # issues at a third of what copy bandwidth allows, so stalls (its barriers, 4 a row in
    # rows_bwd_block_params) rather than issue may bound it (eighteenth stop's note)
    sections="--section SourceCounters"
    [ "$part" = bwd ] && sections="$sections --section WarpStateStats --section Occupancy"
    # shellcheck disable=SC2086
    timeout 80 "$NCU" --clock-control none --profile-from-start off --kernel-name "regex:rows_${part}" \
        $sections -o "/tmp/rows_$part" python3 asv_bench/ncu_rows.py > "$R/ncu_$part.log" 2>&1 &&
    "$NCU" --import "/tmp/rows_$part.ncu-rep" --page source --csv --print-source sass > "$R/rows_${part}_sass.csv" 2>> "$R/ncu_$part.log" &&
    python3 asv_bench/ncu_rows.py --count "$R/rows_${part}_sass.csv" > "$R/ncu_${part}_count.txt" 2>&1
    [ "$part" = bwd ] && "$NCU" --import "/tmp/rows_$part.ncu-rep" --page details > "$R/ncu_bwd_details.txt" 2>&1
    gzip -f "$R/rows_${part}_sass.csv" 2>/dev/null
    snap; elapsed "ncu $part"; cat "$R/ncu_${part}_count.txt" 2>/dev/null
done
