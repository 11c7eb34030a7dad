#!/usr/bin/env bash
# The GPU run on a lent GPU machine (docs/install.md "Testing on a GPU"): the machine has Python
# 3.12, torch 2.11 (CUDA 13), triton and nvcc, but no torchrec, no FBGEMM and no network, and one
# command carries at most 64 MiB. tools/gpu/bundle.py packs TorchRec + CUDA FBGEMM into carry
# folders .gpu/p0, .gpu/p1, ...; each command carries one more (the earlier ones stay on the
# machine while it is warm), and the last one runs the checks:
#
#   tools/gpu/check.sh arrived            # after carrying .gpu/p0: list what is there (timed)
#   tools/gpu/check.sh run [STEPS]        # after carrying the last part: reassemble, install, check
#
# `run` checks every part's SHA-256 against the manifest, unpacks them into $GPU_SITE
# (default /tmp/recsys-site), puts it and the repo on PYTHONPATH and runs tools/gpu/check.py,
# which writes $OUT/gpu_check.json (and the steps' logs).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_check_out}
SITE=${GPU_SITE:-/tmp/recsys-site}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
case "${1:-run}" in
arrived)
    ls -la .gpu/p*/ 2>&1
    du -sh .gpu 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    ;;
run)
    t0=$(date +%s%N)
    if [ ! -f "$SITE/.complete" ]; then
        rm -rf "$SITE"
        $PY tools/gpu/bundle.py --verify --target "$SITE" || { echo "gpu_check: the carried parts are incomplete or damaged"; exit 2; }
        touch "$SITE/.complete"
    fi
    unpack_s=$(( ($(date +%s%N) - t0) / 1000000000 ))
    echo "gpu_check: TorchRec + FBGEMM in $SITE ($unpack_s s)"
    unset TRITON_INTERPRET
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    $PY tools/gpu/check.py --out "$OUT" --only "${2:-env,bench,tests,calibrate}" --budget-s "${GPU_BUDGET_S:-520}" \
        --note "bundle unpacked in $unpack_s s"
    ;;
*)
    echo "usage: tools/gpu/check.sh arrived|run [STEPS]" >&2; exit 2;;
esac
