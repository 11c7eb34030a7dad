#!/usr/bin/env bash
# One stack tier of CI: the project's wheel on one end of the supported version range.
#
#   tools/ci/stack_tier.sh STACK WHEEL        (make test-stacks runs it for default, oldest and newest)
#
# STACK names constraints.txt (default), constraints-oldest.txt or constraints-newest.txt; its first
# line, "# python: X.Y", names the Python. The venv lives outside the repository, in
# $RECSYS_STACKS (default ~/.cache/recsys/stacks), named after the hash of the constraints file, so
# it is built once per version set and reused by every clone. With RECSYS_STACKS_PRUNE=1 (CI: each
# CUDA-build stack is 4-6 GB) the venv is removed when the tier ends, so CI holds one stack at a time.
# Then, from a scratch directory outside the repository:
#   1. pip installs WHEEL with its dependencies (all already there) and no extra: no launcher, no
#      docker client, no TensorBoard, no matplotlib may appear;
#   2. the CowClip op the wheel ships loads (no JIT build) and matches the torch-ops reference; the
#      op's source also compiles against this stack's torch headers (the JIT fallback build);
#   3. `recsys train --config smoke` stops with one line naming the [viz] extra;
#   4. the smoke config trains on 2 ranks with CowClip-Adam (catch-up) and k-step merges (2 hosts);
#   5. recsys-plan make / show / validate a topology-aware plan (cpu-gloo, and dgx-a100-2host on meta);
#   6. tests/integration/training/test_dropin_pipeline.py runs against the installed wheel (RECSYS_TEST_INSTALLED=1);
#   7. tests/integration/cowclip/test_cowclip_sequence.py (CowClip EmbeddingCollection sharding, which leans on torchrec
#      internals that move between versions) runs against the installed wheel.
# Each step prints its seconds; the last line is "stack-STACK: N passed, M failed".
set -uo pipefail

STACK=${1:?usage: tools/ci/stack_tier.sh STACK WHEEL}
WHEEL=$(readlink -f "${2:?usage: tools/ci/stack_tier.sh STACK WHEEL}")
REPO=$(cd "$(dirname "$0")/../.." && pwd)
case "$STACK" in
    default) CONSTRAINTS=$REPO/constraints.txt ;;
    *) CONSTRAINTS=$REPO/constraints-$STACK.txt ;;
esac
[ -f "$CONSTRAINTS" ] || { echo "stack_tier: no constraints file $CONSTRAINTS" >&2; exit 2; }
[ -f "$WHEEL" ] || { echo "stack_tier: no wheel $WHEEL" >&2; exit 2; }
PYV=$(sed -n 's/^# python: *\([0-9.]*\).*/\1/p' "$CONSTRAINTS" | head -1)
[ -n "$PYV" ] || { echo "stack_tier: $CONSTRAINTS does not start with '# python: X.Y'" >&2; exit 2; }

find_python() {  # python$PYV that runs: on PATH, else a pyenv install
    local c
    for c in "$(command -v "python$PYV" 2>/dev/null)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$PYV"*/bin/python"$PYV"; do
        [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys' 2>/dev/null && { echo "$c"; return 0; }
    done
    return 1
}
BASE_PY=$(find_python) || { echo "stack_tier: no Python $PYV found (PATH or pyenv)" >&2; exit 2; }

STACKS=${RECSYS_STACKS:-$HOME/.cache/recsys/stacks}
VENV=$STACKS/$STACK-$(sha1sum "$CONSTRAINTS" | cut -c1-12)
PY=$VENV/bin/python
PIP=("$PY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS")
passed=0
failed=0
failures=()

step() {  # step NAME CMD...: runs CMD, prints its time and verdict
    local name=$1 t0 rc ms
    shift
    t0=$(date +%s%N)
    "$@"
    rc=$?
    ms=$((($(date +%s%N) - t0) / 1000000))
    printf '[stack %s] %-52s %s %d.%d s\n' "$STACK" "$name" "$([ $rc = 0 ] && echo ok || echo FAILED)" \
        $((ms / 1000)) $((ms % 1000 / 100))
    if [ $rc = 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); failures+=("$name"); fi
    return $rc
}

build_venv() {
    [ -f "$VENV/.complete" ] && return 0
    rm -rf "$VENV"
    mkdir -p "$STACKS"
    "$BASE_PY" -m venv "$VENV" || return 1
    # torchrec's own deps, named one by one: `pip install torchrec` would pull the CUDA fbgemm-gpu
    "${PIP[@]}" setuptools torch fbgemm-gpu-cpu tensordict torchmetrics tqdm pyre-extensions iopath \
        numpy PyYAML ninja filelock pytest 2>&1 | grep -v "^WARNING: Location" || true
    "${PIP[@]}" --no-deps torchrec 2>&1 | grep -v "^WARNING: Location" || true
    "$PY" -c "import torch, torchrec, fbgemm_gpu" 2>/dev/null || return 1
    touch "$VENV/.complete"
}

install_wheel() {
    "$PY" -m pip uninstall -q -y torchrec-cowclip-trainer >/dev/null 2>&1
    "${PIP[@]}" "$WHEEL" 2>&1 | grep -v "^WARNING: Location"
    local listed bad
    listed=$("$PY" -m pip list --format=freeze 2>/dev/null | cut -d= -f1 | tr 'A-Z_' 'a-z-')
    bad=$(echo "$listed" | grep -xE 'torchx|torchx-nightly|docker|tensorboard|matplotlib' || true)
    [ -z "$bad" ] || { echo "the bare install pulled: $bad" >&2; return 1; }
    echo "$listed" | grep -qx 'torchrec-cowclip-trainer'
}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/recsys-stack-$STACK.XXXXXX")
cleanup() {
    "$PY" -m pip uninstall -q -y torchrec-cowclip-trainer >/dev/null 2>&1
    rm -rf "$WORK"
    [ "${RECSYS_STACKS_PRUNE:-0}" = 1 ] && rm -rf "$VENV"
    return 0
}
trap cleanup EXIT
cd "$WORK" || exit 2
# the tests' own helpers (tests/support, e.g. the forkserver that starts gloo workers) import as
# `tests.support` from the working directory; the repository itself stays off the import path,
# so `recsys` is the installed wheel's
ln -s "$REPO/tests" "$WORK/tests"
export XDG_CACHE_HOME=$WORK/cache  # a JIT build, if any, lands here (and step 2 checks there is none)
unset PYTHONPATH RECSYS_NO_CPP RECSYS_CPP_JIT RECSYS_EXT_DIR
export PATH=$VENV/bin:$PATH

op_loads() {  # tests/support/op_check.py: the installed recsys and its prebuilt op, against the reference
    local out
    out=$("$PY" "$REPO/tests/support/op_check.py") || return 1
    echo "$out" | grep -v '^MODULE'
    echo "$out" | grep -q "^MODULE .*/site-packages/recsys/__init__.py$" &&  # the wheel, not a checkout
        echo "$out" | grep -q "^REASON installed build " && echo "$out" | grep -q "^MATCH"
}

jit_builds() {  # the fallback build, against this stack's torch, in a cache of its own
    RECSYS_CPP_JIT=1 RECSYS_EXT_DIR=$WORK/jit "$PY" -c "
import recsys.optim.cowclip.kernels.cpp_op as ck
ck.load_extension(require=True)
print(ck.fallback_reason(), f'({ck.build_seconds():.1f} s)')
"
}

names_the_viz_extra() {
    local out rc
    out=$(recsys train --config smoke "run_dir=$WORK/no-extra" 2>&1)
    rc=$?
    echo "$out"
    [ $rc = 2 ] && [ "$(echo "$out" | wc -l)" = 1 ] && echo "$out" | grep -q "pip install 'torchrec-cowclip-trainer\[viz\]'"
}

trains_cowclip_kstep() {
    recsys train --config smoke optim.embedding=cowclip_adam optim.embedding_l2_scope=catchup \
        train.hosts=2 train.merge_every=8 train.max_steps=100 train.tensorboard=false train.curves=false \
        "run_dir=$WORK/smoke" 2>&1 | tail -3 || return 1
    "$PY" - "$WORK/smoke/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["steps"] == 100 and s["hosts"] == 2 and s["merges"] >= 12, s
assert 0.6 < s["auc"] <= 1.0, s["auc"]
print("auc", round(s["auc"], 4), "merges", s["merges"])
EOF
}

plans() {
    recsys-plan make --config smoke --topology cpu-gloo --compute-device cpu --out plan.json | tail -1 &&
        recsys-plan show plan.json --topology cpu-gloo | tail -2 &&
        recsys-plan validate plan.json &&
        recsys-plan make --config demo --topology dgx-a100-2host --out plan-dgx.json | tail -1 &&
        recsys-plan validate plan-dgx.json
}

dropin_test() {
    RECSYS_TEST_INSTALLED=1 "$PY" -m pytest -q -p no:cacheprovider -c /dev/null --rootdir "$WORK" \
        "$REPO/tests/integration/training/test_dropin_pipeline.py" 2>&1 | tail -3
}

sequence_test() {  # the tests directory is on sys.path (pytest's rootdir-less import), the repository is not
    "$PY" -m pytest -q -p no:cacheprovider -c /dev/null --rootdir "$WORK" \
        "$REPO/tests/integration/cowclip/test_cowclip_sequence.py" 2>&1 | tail -3
}

echo "[stack $STACK] Python $PYV ($BASE_PY), $CONSTRAINTS, venv $VENV"
step "venv (built once per constraints file)" build_venv || { echo "stack-$STACK: 0 passed, 1 failed"; exit 1; }
step "pip install the wheel, no extras" install_wheel || { echo "stack-$STACK: $passed passed, $failed failed"; exit 1; }
step "CowClip op: installed build, matches the reference" op_loads
step "CowClip op: JIT build against this torch" jit_builds
step "recsys train without [viz]: one line" names_the_viz_extra
step "smoke, 2 ranks: CowClip catch-up + k-step merges" trains_cowclip_kstep
step "recsys-plan make/show/validate (topology-aware)" plans
step "drop-in pipeline test against the wheel" dropin_test
step "CowClip EmbeddingCollection test against the wheel" sequence_test
[ -z "$(ls -A "$XDG_CACHE_HOME/recsys" 2>/dev/null)" ] || { echo "a JIT build happened: $(ls "$XDG_CACHE_HOME/recsys")"; failed=$((failed + 1)); }
[ $failed = 0 ] || echo "[stack $STACK] failed: ${failures[*]}"
echo "stack-$STACK: $passed passed, $failed failed"
[ $failed = 0 ]
