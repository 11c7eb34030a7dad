"""The wheel works anywhere: built from a copy of the working tree (`pip wheel --no-deps
--no-build-isolation`), installed with `pip install --no-deps --target`, and used from another
directory with only that install on PYTHONPATH (torch, torchrec, torchx come from the venv):

- the wheel holds exactly the import packages `recsys`, `sharding`, `torchx_components` (+ its
  dist-info), with the shipped topologies, experiment configs and C++ source as package data;
- `recsys-plan make` plans with a shipped topology name and a shipped config name, `show` reads it;
- the CowClip op built at install time loads with no JIT build (no "building" line, nothing new in
  the cache or site-packages) and matches the torch-ops reference;
- an installed op built from another source is not used: the JIT fallback prints its one line and
  builds into the per-user cache (XDG_CACHE_HOME), never into site-packages; a second process
  reuses that build silently;
- `torchx builtins` lists the registered components next to torchx's own.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PY = sys.executable  # the venv's python: torch, torchrec, torchx come from there
PACKAGES = {"recsys", "sharding", "torchx_components"}
DIST_INFO = "torchrec_cowclip_trainer-0.1.0.dist-info"


def _setup_flags() -> dict[str, list[str]]:
    """CXX_FLAGS / LD_FLAGS as written in setup.py (read, not run: running it would build)."""
    out = {}
    for node in ast.parse((REPO / "setup.py").read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(target, ast.Name):
            if target.id in ("CXX_FLAGS", "LD_FLAGS"):
                out[target.id] = ast.literal_eval(node.value)
    return out


def test_install_build_uses_the_jit_flags():
    """setup.py and the JIT fallback compile with the same flags (so the same speed)."""
    import recsys.optim.cowclip.kernels.cpp_op as ck

    assert _setup_flags() == {"CXX_FLAGS": ck.CXX_FLAGS, "LD_FLAGS": ck.LD_FLAGS}


# ---------------------------------------------------------------------------------------------
# Build and install once per module (~15 s: the C++ op is compiled)


def _copy_worktree(dst: Path) -> None:
    """The files git would commit (tracked + untracked, not ignored): no build/, no in-place .so."""
    names = (
        subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, check=True)
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, names):
        src = REPO / name
        if name == ".venv" or not (src.is_file() or src.is_symlink()):
            continue
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / name, follow_symlinks=False)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, site = tmp / "src", tmp / "dist", tmp / "site"
    _copy_worktree(src)
    before = _files(src)
    env = dict(os.environ, PATH=f"{Path(PY).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # the venv's ninja
    r = subprocess.run(
        [PY, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-w", str(dist), str(src)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # building leaves the source tree as it was: no build/, no *.egg-info, no compiled op
    assert _files(src) == before, sorted(_files(src) ^ before)[:20]
    assert not (src / "build").exists() and not list(src.glob("*.egg-info"))
    (wheel,) = dist.glob("*.whl")
    r = subprocess.run(
        [PY, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    work = tmp / "elsewhere"
    work.mkdir()
    return {"wheel": wheel, "site": site, "work": work, "tmp": tmp}


def _env(site: Path, cache: Path, **extra: str) -> dict[str, str]:
    """Only the installed wheel on PYTHONPATH; JIT builds (if any) go to `cache`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RECSYS_EXT_DIR", "RECSYS_NO_CPP", "RECSYS_CPP_JIT")}
    env.update(PYTHONPATH=str(site), XDG_CACHE_HOME=str(cache), **extra)
    return env


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _files(root: Path) -> set[str]:
    """Every file under root, relative, bytecode caches left out (imports write those)."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_wheel_holds_only_the_project_packages_and_their_data(installed):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    assert {n.split("/")[0] for n in names} == PACKAGES | {DIST_INFO}
    data = {n for n in names if not n.endswith(".py") and not n.startswith(DIST_INFO)}
    assert {
        "sharding/topologies/cpu-gloo.yaml",
        "sharding/topologies/dgx-a100-2host.yaml",
        "recsys/configs/experiments/demo.yaml",
        "recsys/configs/experiments/smoke.yaml",
        "recsys/optim/csrc/cowclip_adam.cpp",
        "recsys/optim/_cowclip_C.sha256",
    } <= data
    assert [n for n in data if n.startswith("recsys/optim/_cowclip_C") and n.endswith(".so")]
    # installed: the same three packages (+ dist-info and pip's bin/ for the console scripts)
    assert {p.name for p in installed["site"].iterdir()} == PACKAGES | {DIST_INFO, "bin"}
    entry_points = (installed["site"] / DIST_INFO / "entry_points.txt").read_text()
    assert "recsys-plan = recsys.plan_cli:main" in entry_points
    assert "recsys = torchx_components.launch" in entry_points


def test_one_wheel_for_every_python_and_torch_of_the_range(installed):
    """The op uses torch's stable ABI only (C shim symbols, no ATen/c10 C++, no CPython), so the
    wheel is tagged cp311-abi3 and one file serves Python 3.11-3.13 and torch 2.11-2.14 (CI's
    stack tiers install this file into the oldest and newest stacks)."""
    wheel = installed["wheel"]
    assert wheel.name == "torchrec_cowclip_trainer-0.1.0-cp311-abi3-linux_x86_64.whl", wheel.name
    (lib,) = (installed["site"] / "recsys" / "optim").glob("_cowclip_C*.so")
    assert lib.name == "_cowclip_C.abi3.so"
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True, text=True, check=True).stdout.split()
    symbols = {w for w in undefined if w not in ("U", "w") and "@" not in w and not w.startswith("_ITM_") and w != "__gmon_start__"}
    torch_calls = {w for w in symbols if w.startswith(("aoti_torch_", "torch_"))}
    assert torch_calls and {"torch_parallel_for", "aoti_torch_empty_strided"} <= torch_calls
    assert not {w for w in symbols if w.startswith("Py")}, "CPython API used: the abi3 tag would lie"
    tied = {w for w in symbols if w.startswith("_Z") and any(n in w for n in ("N2at", "3c10", "5torch"))}
    assert not tied, f"C++ symbols of torch (the library would be tied to one torch version): {sorted(tied)[:5]}"


def test_plan_with_shipped_names_from_another_directory(installed):
    site, work = installed["site"], installed["work"]
    env = _env(site, installed["tmp"] / "cache-plan")
    r = _run(
        [
            PY,
            "-c",
            "import recsys, sharding, torchx_components; "
            "from sharding.topology.topology_file import load_topology; "
            "print(recsys.__file__, sharding.__file__, torchx_components.__file__, "
            "load_topology('dgx-a100-2host').world_size, load_topology('cpu-gloo').world_size)",
        ],
        work,
        env,
    )
    assert r.returncode == 0, r.stderr
    *files, dgx, cpu = r.stdout.split()
    assert all(f.startswith(str(site)) for f in files), files  # the wheel, not the repository
    assert (int(dgx), int(cpu)) == (16, 2)

    r = _run(
        [
            PY,
            "-m",
            "recsys.plan_cli",
            "make",
            "--config",
            "smoke",
            "--topology",
            "cpu-gloo",
            "--compute-device",
            "cpu",
            "--out",
            "plan.json",
        ],
        work,
        env,
    )
    assert r.returncode == 0, r.stderr
    plan = json.loads((work / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["meta"]["topology"] == "cpu-gloo", {k: plan[k] for k in ("world_size", "meta")}
    wrote = re.search(r"^wrote plan\.json: (\d+) tables on 2 ranks$", r.stdout, re.M)
    assert wrote, r.stdout
    n_tables = int(wrote.group(1))

    # the installed console script, as a user runs it
    r = _run([str(site / "bin" / "recsys-plan"), "show", "plan.json", "--format", "json"], work, env)
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert len(shown["tables"]) == n_tables and len(shown["ranks"]) == 2

    # plan files carry their tables' shapes and optimizer state: validate needs no config
    r = _run([PY, "-m", "recsys.plan_cli", "validate", "plan.json"], work, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"valid: {n_tables} tables")


CHECK_OP = str(REPO / "tests" / "support" / "op_check.py")  # run as a script: the installed recsys, not this checkout


def test_installed_op_loads_without_a_jit_build(installed):
    site, cache = installed["site"], installed["tmp"] / "cache-op"
    before = _files(site)
    r = _run([PY, CHECK_OP], installed["work"], _env(site, cache))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MATCH" in r.stdout
    reason = r.stdout.split("REASON ", 1)[1].splitlines()[0]
    assert reason.startswith(f"installed build {site}/recsys/optim/_cowclip_C"), reason
    assert "building" not in r.stderr, r.stderr
    assert not (cache / "recsys").exists()
    assert _files(site) == before and not (site / "build").exists()


def test_stale_installed_op_falls_back_to_one_line_jit_build_in_user_cache(installed, tmp_path):
    """An installed op built from another source (an editable install whose C++ changed) is not
    used; the JIT build says so in one line and goes to $XDG_CACHE_HOME/recsys, not site-packages."""
    site = tmp_path / "site"
    shutil.copytree(installed["site"], site, symlinks=True)
    (site / "recsys" / "optim" / "_cowclip_C.sha256").write_text("0" * 64 + "\n")
    cache = tmp_path / "cache"
    before = _files(site)
    first = _run([PY, CHECK_OP], installed["work"], _env(site, cache), timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "MATCH" in first.stdout
    building = [ln for ln in first.stderr.splitlines() if "building" in ln]
    assert len(building) == 1, first.stderr
    build_dir = building[0].split(" into ", 1)[1]
    assert building[0] == f"building the CowClip op (first use, ~10 s) into {build_dir}"
    assert build_dir.startswith(f"{cache}/recsys/torch_extensions/py"), build_dir
    assert (Path(build_dir) / "recsys_cowclip_adam.so").is_file()
    assert first.stdout.split("REASON ", 1)[1].splitlines()[0] == f"JIT build in {build_dir}"
    assert _files(site) == before and not (site / "build").exists()
    # a second process (another rank, a later run) reuses the build, silently
    again = _run([PY, CHECK_OP], installed["work"], _env(site, cache))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "building" not in again.stderr and "MATCH" in again.stdout


def test_torchx_builtins_lists_the_components(installed):
    r = _run(
        [str(Path(PY).parent / "torchx"), "builtins"],
        installed["work"],
        _env(installed["site"], installed["tmp"] / "cache-tx"),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    listed = {line.split(". ", 1)[1].strip() for line in r.stdout.splitlines() if ". " in line}
    assert {"recsys.train", "recsys.plan", "recsys.preprocess"} <= listed
    assert {"dist.ddp", "utils.python"} <= listed  # torchx's own stay listed


EDITABLE_CHECK = """
import site, sys
sys.path.append(sys.argv[1])  # the venv's packages, without its .pth files (its editable recsys)
site.addsitedir(sys.argv[2])  # the editable install under test (its .pth maps recsys to the copy)
import recsys
import recsys.optim.cowclip.kernels.cpp_op as ck
ck.load_extension(require=True)
print(recsys.__file__)
print(ck.fallback_reason())
"""


def test_editable_install_builds_the_op(tmp_path):
    """`pip install --no-build-isolation -e .` (what `make venv` runs) builds the op in place."""
    src, target = tmp_path / "src", tmp_path / "site"
    _copy_worktree(src)
    env = dict(os.environ, PATH=f"{Path(PY).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    r = subprocess.run(
        [PY, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-e", str(src), "--target", str(target)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    venv_site = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir())
    work = tmp_path / "elsewhere"
    work.mkdir()
    r = _run([PY, "-S", "-c", EDITABLE_CHECK, venv_site, str(target)], work, _env(target, tmp_path / "cache"))
    assert r.returncode == 0, r.stderr[-3000:]
    module, reason = r.stdout.splitlines()[-2:]
    assert module == f"{src}/recsys/__init__.py"
    assert reason.startswith(f"installed build {src}/recsys/optim/_cowclip_C"), reason
    assert "building" not in r.stderr and not (tmp_path / "cache" / "recsys").exists()
