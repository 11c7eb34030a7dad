"""The Triton kernel bodies of the catch-up (recsys/optim/cowclip/kernels/triton_catchup_kernel.py):
``_catch_up_rows_kernel`` and ``_claim_advance_kernel`` around the shared row body ``_advance_row``,
compiled ahead of time for GPUs. Their numbers are tested through their launchers in
test_triton_catchup.py; what only the compiler sees (the interpreter accepts more, and it has no
PTX) is tested here: the bodies compile to cubin, and the claim is a 64-bit atomic max.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]

AOT = """
import re
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import recsys.optim.cowclip.kernels.triton_catchup as cct
fn = cct._kernel()
sig = {"W": "*fp32", "M": "*fp32", "V": "*fp32", "RS": "*i64", "WOFF": "*i64", "RSI": "*i64", "DIMS": "*i32",
       "HP": "*fp64", "CONST": "*fp64", "n_const": "i32", "step": "i64", **{k: "fp32" for k in "b1f b2f c_m c_v c2 epsf".split()},
       "KERAS": "constexpr", "BLOCK_D": "constexpr"}
for cap in (80, 90):
    for keras in (False, True):
        src = ASTSource(fn=fn, signature=sig, constexprs={"KERAS": keras, "BLOCK_D": 16})
        k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": 1})
        assert len(k.asm["cubin"]) > 1000
        print(cap, "catch-up", keras, "ok")
fn = cct._lookup_kernel()
sig = {"W": "*fp32", "M": "*fp32", "V": "*fp32", "RS": "*i64", "IDX": "*i32", "OFFSETS": "*i32", "META": "*i64",
       "L": "i32", "F": "i32", "B": "i32", "OUT_WOFF": "*i64", "OUT_RS": "*i64", "OUT_D": "*i32", "COUNTS": "*i32",
       "HP": "*fp64", "CONST": "*fp64", "n_const": "i32", "step": "i32",  # a small int argument is int32
       **{k: "fp32" for k in "b1f b2f c_m c_v c2 epsf".split()},
       **{k: "constexpr" for k in ("BLOCK", "SEARCH_STEPS", "KERAS", "BLOCK_D")}}
for cap in (80, 90):
    for keras, idx in ((False, "*i64"), (True, "*i32")):
        src = ASTSource(fn=fn, signature={**sig, "IDX": idx, "OFFSETS": idx},
                        constexprs={"BLOCK": cct.LOOKUP_BLOCK, "SEARCH_STEPS": 5, "KERAS": keras, "BLOCK_D": 16})
        k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": 1})
        assert re.search(r"atom\\.global\\.[a-z_.]*max\\.[su]64", k.asm["ptx"]), "no 64-bit atomic max"
        print(cap, "catch-up per id", keras, "ok")
"""


@pytest.mark.usefixtures("needs_triton")
def test_catch_up_kernels_compile_for_gpus_without_one(tmp_path):
    """Compile both catch-up kernels ahead of time to cubin for sm_80 and sm_90 (ptxas ships with
    triton; no GPU or driver needed), in a process that imports triton in compiled mode: the
    per-row kernel in both eps modes, the per-id kernel with int64 and int32 ids, whose PTX claims
    rows with a 64-bit atomic max on ``row_step``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]), TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, "-c", AOT], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("ok") == 8
