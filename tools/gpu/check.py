"""The GPU checks in one run, each in its own process with its own time limit, written into one
JSON (``$OUT/gpu_check.json``; ``docs/results/gpu_check.json`` keeps the last full run).

Run by ``tools/gpu/check.sh`` on a GPU machine after it has put TorchRec and CUDA FBGEMM on
``PYTHONPATH``; runnable anywhere (on a machine without CUDA every GPU test skips and the record
says so). The checks, in this order (the short, decisive figures first):

  env        the machine (nvidia-smi), versions, and the C++ CowClip op (built on first use)
  bench      tools/bench/cowclip.py --device cuda: our CowClip-Adam step vs FBGEMM's CUDA
             EXACT_ROWWISE_ADAGRAD and ADAM (1M rows x batch 8K x 26 tables x dim 16)
  tests      pytest tests/gpu (``make test-gpu``): NCCL, FBGEMM's fused / fused_uvm /
             fused_uvm_caching tables through DMP, CowClip tables in UVM with a DCP round trip,
             the Triton kernels against the CPU op, the 200-step DeepFM on CUDA with checkpoint,
             resume and the CPU run of the same seed
  calibrate  tools/bench/calibrate_cost_model.py --nproc 1: the cost model's HBM / UVM lookup times
             against measured ones

    python3 tools/gpu/check.py --out DIR [--only env,bench] [--budget-s 520]
    GPU_TESTS="tests/gpu/test_triton_cuda.py" python3 tools/gpu/check.py --only env,tests   # some tests only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS = ("env", "bench", "tests", "calibrate")
# seconds each step may take at most (the whole run must end inside one device command, 600 s)
LIMITS = {"env": 90, "bench": 90, "tests": 330, "calibrate": 120}


def _run(cmd: list[str], log: Path, limit: float, env: dict | None = None) -> dict:
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            p = subprocess.run(
                cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=limit, env={**os.environ, **(env or {})}
            )
            out, rc = p.stdout, p.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc = None
        f.write(out)
    res = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1)}
    if rc is None:
        res["status"] = f"timed out after {limit:.0f} s"
    res["tail"] = out[-1500:]
    res["stdout"] = out
    return res


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def step_env(out: Path, limit: float) -> dict:
    code = r"""
import json, time, platform
t0 = time.perf_counter()
import torch
res = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
try:
    import triton; res["triton"] = triton.__version__
except Exception as e: res["triton"] = f"missing: {e}"
t1 = time.perf_counter()
try:
    import fbgemm_gpu; res["fbgemm_gpu"] = fbgemm_gpu.__version__
    res["fbgemm_variant"] = getattr(fbgemm_gpu, "__variant__", "?")
except Exception as e: res["fbgemm_gpu"] = f"failed: {type(e).__name__}: {e}"[:400]
res["fbgemm_import_s"] = round(time.perf_counter() - t1, 1)
try:
    import torchrec; res["torchrec"] = torchrec.__version__
except Exception as e: res["torchrec"] = f"failed: {type(e).__name__}: {e}"[:400]
t2 = time.perf_counter()
import recsys.optim.cowclip.kernels.cpp_op as ck
res["cowclip_op"] = ck.fused_available(); res["cowclip_op_how"] = ck.fallback_reason()
res["cowclip_op_s"] = round(time.perf_counter() - t2, 1)
print(json.dumps(res))
"""
    r = _run([sys.executable, "-c", code], out / "env.log", limit)
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], capture_output=True, text=True
        )
        smi_line = smi.stdout.strip() or smi.stderr.strip()[:200]
    except FileNotFoundError:
        smi_line = "no nvidia-smi"
    r["figures"] = {**(_last_json(r["stdout"]) or {}), "nvidia_smi": smi_line, "cpu_cores": os.cpu_count(), "host": platform.node()}
    fig = r["figures"]
    r["passed"] = (
        r["rc"] == 0
        and bool(fig.get("cowclip_op"))
        and bool(fig.get("gpus"))
        and not any(str(fig.get(k, "failed")).startswith("failed") for k in ("fbgemm_gpu", "torchrec"))
    )
    return r


def step_bench(out: Path, limit: float) -> dict:
    r = _run(
        [sys.executable, "tools/bench/cowclip.py", "--device", "cuda", "--iters", "30", "--warmup", "5", "--profile", "5"],
        out / "bench.log",
        limit,
    )
    fig = _last_json(r["stdout"])
    r["figures"] = fig
    r["passed"] = r["rc"] == 0 and bool(fig) and bool(fig.get("checks")) and all(fig["checks"].values())
    return r


def step_tests(out: Path, limit: float) -> dict:
    xml = out / "junit.xml"
    select = os.environ.get("GPU_TESTS", "tests/gpu").split()  # pytest node ids: a rerun of some tests
    r = _run([sys.executable, "-m", "pytest", "-ra", "-p", "no:cacheprovider", f"--junitxml={xml}", *select], out / "tests.log", limit)
    r["selected"] = select
    tests = {}
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = case.get("name")
            outcome = "passed"
            for kind in ("failure", "error", "skipped"):
                el = case.find(kind)
                if el is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                    msg = (el.get("message") or el.text or "")[:600]
                    break
            t = {"outcome": outcome, "seconds": round(float(case.get("time", 0)), 1)}
            if outcome != "passed":
                t["message"] = msg
            props = case.find("properties")
            if props is not None:
                t["figures"] = {p.get("name"): _num(p.get("value")) for p in props.iter("property")}
            tests[name] = t
    r["figures"] = {"tests": tests}
    # world-2 tests skip on a one-GPU machine (their reason says so); none may fail
    r["passed"] = (
        r["rc"] == 0
        and any(t["outcome"] == "passed" for t in tests.values())
        and not any(t["outcome"] in ("failed", "error") for t in tests.values())
    )
    return r


def _num(v: str | None):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def step_calibrate(out: Path, limit: float) -> dict:
    r = _run(
        [sys.executable, "tools/bench/calibrate_cost_model.py", "--nproc", "1", "--topology", "dgx-h100", "--reps", "20"],
        out / "calibrate.log",
        limit,
    )
    r["figures"] = _last_json(r["stdout"])
    r["passed"] = r["rc"] == 0 and r["figures"] is not None
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    ap.add_argument("--only", default=",".join(STEPS), help="comma-separated steps, of " + ",".join(STEPS))
    ap.add_argument("--budget-s", type=float, default=540, help="stop starting steps once less than a step's limit is left of this")
    ap.add_argument("--note", default="", help="written into the record (e.g. the carried parts' timings)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    record: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "note": args.note, "steps": {}}
    for name in [s for s in STEPS if s in args.only.split(",")]:
        left = args.budget_s - (time.perf_counter() - t0)
        if left < 20:
            record["steps"][name] = {"passed": False, "status": f"not run: {left:.0f} s of the budget left"}
            continue
        limit = min(LIMITS[name], left)
        print(f"[gpu_check] {name} (limit {limit:.0f} s) ...", flush=True)
        res = globals()[f"step_{name}"](out, limit)
        res.pop("stdout", None)
        record["steps"][name] = res
        print(f"[gpu_check] {name}: {'passed' if res['passed'] else 'FAILED'} in {res['seconds']} s", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(record, indent=1))
    record["total_s"] = round(time.perf_counter() - t0, 1)
    record["passed"] = all(s.get("passed") for s in record["steps"].values())
    (out / "gpu_check.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v.get("passed") for k, v in record["steps"].items()} | {"total_s": record["total_s"]}))
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
