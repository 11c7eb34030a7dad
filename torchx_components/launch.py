"""TorchX components: launch recsys training with torchrun (c10d rendezvous) on any TorchX
scheduler: `local_cwd` on this machine, `slurm` on a cluster. See docs/launch.md.

    torchx run -s local_cwd torchx_components/launch.py:train \\
        --config configs/experiments/smoke.yaml -- train.max_steps=40 run_dir=runs/tx
    torchx run -s local_cwd recsys.train --config smoke   # by its registered name, from anywhere
    torchx run -s slurm -cfg partition=debug torchx_components/launch.py:train \\
        --nnodes 2 --nproc_per_node 8 --gpu 8 --config configs/experiments/demo.yaml

Bad input (a missing or invalid config, an unknown override key, impossible resources) stops
the component with one line, `error: ...`, before anything is submitted: the component raises
`LaunchError`, a `SystemExit` carrying that line, so the `torchx` CLI prints it without a
traceback and exits 1; Python callers (`torchx.runner`) can catch it as `SystemExit`.

How the job finds the right Python: the worker command runs the interpreter that built the
component (`sys.executable`, i.e. the venv's python when you run the venv's `torchx`) by its
absolute path, as `python -m recsys.training.torchrun_quiet` (torchrun, as `recsys train` runs
it: a worker's one-line error is not followed by torchrun's multi-line `ChildFailedError`);
torchrun starts the workers with that same interpreter. The venv's `bin` is also put first on the job's PATH, so anything that runs
`python`/`torchrun` by name gets the venv too. On a cluster that path must exist on every node
(shared filesystem); pass `--python` to use another interpreter.

`plan` runs `recsys-plan make` as a one-process job (plans are made on CPU for any cluster):

    torchx run -s local_cwd torchx_components/launch.py:plan \
        --config configs/experiments/demo.yaml --world_size 16 --hbm_gb 80 --out plans/p16.json
"""

import os
import shlex
import sys
from typing import Dict, Optional

import torchx.specs as specs
from torchx.specs import macros

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Below this much memory per training process the smoke config already fails to start (torch,
# torchrec and FBGEMM alone take a few hundred MB per process).
MIN_MEM_MB_PER_PROC = 512
ROLE = "trainer"


class LaunchError(SystemExit):
    """Bad component input. A `SystemExit` whose message is one line, `error: ...`, so the
    torchx CLI prints just that line and exits 1, before anything is submitted."""

    def __init__(self, msg: str) -> None:
        super().__init__(f"error: {msg}")


class _noquote(str):
    """An argument that must reach `bash -c` unquoted (it holds a `${VAR}` to expand)."""


def _join(args: list[str]) -> str:
    return " ".join(a if isinstance(a, _noquote) else shlex.quote(a) for a in args)


def _optional_int(option: str, value: object) -> Optional[int]:
    """torchx's CLI hands an `Optional[int]` option over as a string; accept both."""
    if value is None or isinstance(value, int):
        return value
    try:
        return int(str(value))
    except ValueError:
        raise LaunchError(f"train: --{option} must be an integer, got {value!r}") from None


def _check_resources(
    nnodes: int, nproc: Optional[int], cpu: int, gpu: int, memMB: int, max_restarts: int, max_retries: int, rdzv_port: int
) -> None:
    if nnodes < 1:
        raise LaunchError(f"train: --nnodes must be at least 1, got {nnodes}")
    if nproc is None:  # not known yet (taken from the config): the rest is checked later
        pass
    elif nproc < 1:
        raise LaunchError(f"train: --nproc_per_node must be at least 1, got {nproc}")
    if cpu < 1:
        raise LaunchError(f"train: --cpu (cores per node) must be at least 1, got {cpu}")
    if gpu < 0:
        raise LaunchError(f"train: --gpu must be 0 or more, got {gpu}")
    if nproc is not None and 0 < gpu < nproc:
        raise LaunchError(f"train: --gpu {gpu} is fewer than --nproc_per_node {nproc}; each process needs its own GPU")
    if nproc is not None and memMB < MIN_MEM_MB_PER_PROC * nproc:
        raise LaunchError(
            f"train: --memMB {memMB} is too little for {nproc} processes per node "
            f"(at least {MIN_MEM_MB_PER_PROC} MB each, {MIN_MEM_MB_PER_PROC * nproc} MB)"
        )
    if max_restarts < 0 or max_retries < 0:
        raise LaunchError(f"train: --max_restarts and --max_retries must be 0 or more, got {max_restarts} and {max_retries}")
    if not 0 < rdzv_port < 65536:
        raise LaunchError(f"train: --rdzv_port must be in 1..65535, got {rdzv_port}")


def train(
    *overrides: str,
    config: str,
    nnodes: int = 1,
    nproc_per_node: Optional[int] = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 8192,
    max_restarts: int = 0,
    max_retries: int = 0,
    resume: bool = True,
    env: Optional[Dict[str, str]] = None,
    rdzv_port: int = 29500,
    name: str = "recsys-train",
    python: str = "",
) -> specs.AppDef:
    """Train a recsys model: `nnodes` x `nproc_per_node` processes started by torchrun with c10d
    rendezvous, each running `python -m recsys.train --config CONFIG [overrides]`. The config and
    overrides are checked before submission (one-line errors). Run from the repository root: the
    job runs in the submit directory (local_cwd and slurm), where relative paths resolve.

    Args:
        overrides: key=value config overrides for recsys.train, e.g. train.max_steps=40 run_dir=runs/x
        config: experiment YAML, relative to the submit directory or absolute, or a shipped name (demo, smoke)
        nnodes: number of nodes (hosts); each runs one torchrun agent
        nproc_per_node: training processes per node; None: the config's train.nproc_per_node
        cpu: CPU cores per node to request from the scheduler
        gpu: GPUs per node to request (0 for CPU training; otherwise at least nproc_per_node)
        memMB: memory per node in MB to request
        max_restarts: torchrun restarts of the worker group within one allocation (resumes from the last checkpoint)
        max_retries: scheduler retries of the whole job after a failure (Slurm: requeue)
        resume: continue from the newest checkpoint in run_dir if there is one (what makes a requeued or restarted job resume)
        env: extra environment variables for the workers, e.g. A=1,B=2
        rdzv_port: port of the c10d rendezvous store on the first node (multi-node only; one node picks a free port)
        name: job name
        python: Python interpreter on the nodes; empty: the one running this component (the venv's)
    """
    nproc_per_node = _optional_int("nproc_per_node", nproc_per_node)
    _check_resources(nnodes, nproc_per_node, cpu, gpu, memMB, max_restarts, max_retries, rdzv_port)
    overrides = list(overrides)
    if resume:
        overrides.append("resume=true")
    if nproc_per_node is not None:
        overrides.append(f"train.nproc_per_node={nproc_per_node}")

    # The project's own config check (unknown keys, wrong types, impossible values, missing file).
    from recsys.config import ConfigError, load_config

    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        raise LaunchError(str(e).replace("\n", " ")) from None
    nproc = cfg.train.nproc_per_node
    _check_resources(nnodes, nproc, cpu, gpu, memMB, max_restarts, max_retries, rdzv_port)

    python = python or sys.executable
    if nnodes == 1:
        # one torchrun agent: port 0 lets the c10d store pick a free port
        endpoint = "localhost:0"
    else:
        # the scheduler names the first node in rank0_env (Slurm: SLURM_JOB_NODELIST_HET_GROUP_0);
        # `$$` escapes the macro template, bash expands the variable at run time
        endpoint = _noquote(f"$${{{macros.rank0_env}:=localhost}}:{rdzv_port}")
    cmd = [  # torchrun without its multi-line reports of failures the workers explained in one line
        python,
        "-m",
        "recsys.training.torchrun_quiet",
        "--nnodes",
        str(nnodes),
        "--nproc_per_node",
        str(nproc),
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        endpoint,
        "--rdzv_id",
        _noquote(macros.app_id),
        "--max_restarts",
        str(max_restarts),
        "-m",
        "recsys.train",
        "--config",
        config,
        *overrides,
    ]
    bindir = os.path.dirname(python) if os.path.isabs(python) else ""
    script = _join(cmd)
    if bindir:
        script = f'export PATH={shlex.quote(bindir)}:"$${{PATH}}"; exec {script}'
    else:
        script = f"exec {script}"

    role_env = {"OMP_NUM_THREADS": str(max(1, cpu // nproc)), "PYTHONUNBUFFERED": "1"}
    role_env.update(env or {})
    return specs.AppDef(
        name=name,
        roles=[
            specs.Role(
                name=ROLE,
                image=REPO,
                entrypoint="bash",
                args=["-c", script],
                num_replicas=nnodes,
                resource=specs.Resource(cpu=cpu, gpu=gpu, memMB=memMB),
                env=role_env,
                port_map={"c10d": rdzv_port},
                max_retries=max_retries,
            )
        ],
    )


def plan(
    *overrides: str,
    config: str,
    out: str,
    world_size: int = 8,
    local_world_size: int = 8,
    compute_device: str = "cuda",
    hbm_gb: float = 0.0,
    ddr_gb: float = 0.0,
    batch_size: int = 0,
    cpu: int = 1,
    memMB: int = 4096,
    name: str = "recsys-plan",
    python: str = "",
) -> specs.AppDef:
    """Make a sharding plan with `recsys-plan make` (one process; the model is built on `meta`,
    so a GPU cluster is planned on a CPU node). The config and options are checked before
    submission.

    Args:
        overrides: key=value config overrides, e.g. data.cardinalities=criteo_kaggle_raw
        config: experiment YAML (model and data sections), relative to the submit directory or absolute, or a shipped name
        out: plan file to write (JSON; written atomically)
        world_size: ranks of the cluster to plan for
        local_world_size: ranks per host
        compute_device: cuda or cpu
        hbm_gb: HBM per GPU in GB (0: torchrec's default)
        ddr_gb: host memory per rank in GB (0: torchrec's default)
        batch_size: global batch (0: the config's train.batch_size)
        cpu: CPU cores to request
        memMB: memory in MB to request
        name: job name
        python: Python interpreter on the node; empty: the one running this component
    """
    if world_size < 1 or local_world_size < 1 or world_size % local_world_size:
        raise LaunchError(f"plan: --world_size {world_size} is not a positive multiple of --local_world_size {local_world_size}")
    if compute_device not in ("cuda", "cpu"):
        raise LaunchError(f"plan: --compute_device must be cuda or cpu, got {compute_device!r}")
    if hbm_gb < 0 or ddr_gb < 0 or batch_size < 0 or cpu < 1 or memMB < 1024:
        raise LaunchError("plan: --hbm_gb, --ddr_gb, --batch_size must be >= 0, --cpu >= 1 and --memMB >= 1024")
    from recsys.config import ConfigError, load_config

    try:
        load_config(config, list(overrides))
    except ConfigError as e:
        raise LaunchError(str(e).replace("\n", " ")) from None
    python = python or sys.executable
    cmd = [
        python,
        "-m",
        "recsys.plan_cli",
        "make",
        "--config",
        config,
        "--out",
        out,
        "--world-size",
        str(world_size),
        "--local-world-size",
        str(local_world_size),
        "--compute-device",
        compute_device,
        "--hbm-gb",
        str(hbm_gb),
        "--ddr-gb",
        str(ddr_gb),
        "--batch-size",
        str(batch_size),
    ]
    for o in overrides:
        cmd += ["--set", o]
    return specs.AppDef(
        name=name,
        roles=[
            specs.Role(
                name="planner",
                image=REPO,
                entrypoint="bash",
                args=["-c", f"exec {_join(cmd)}"],
                num_replicas=1,
                resource=specs.Resource(cpu=cpu, gpu=0, memMB=memMB),
                env={"PYTHONUNBUFFERED": "1"},
            )
        ],
    )


def preprocess(
    *overrides: str,
    config: str,
    tasks: int = 1,
    procs_per_task: int = 2,
    cpu: int = 2,
    memMB: int = 4096,
    max_retries: int = 0,
    name: str = "recsys-preprocess",
    python: str = "",
) -> specs.AppDef:
    """Preprocess the config's raw files into its shard cache, fanned out over `tasks` x
    `procs_per_task` parts: each part takes a contiguous, byte-balanced group of the files and
    writes its own shard directory; the last part to finish joins them into one dataset without
    copying the arrays (recsys/data/preprocess/fanout.py). The tasks are the replicas of one role (TorchX's
    fan-out; on Slurm one component of a heterogeneous job each, on its own node); each task
    runs `recsys preprocess --task i --tasks N --procs P`, i.e. P local processes. On local_cwd
    the tasks are local process trees. Training with the same config then finds the cache up to date.

    Args:
        overrides: key=value config overrides, e.g. data.path=/data/day_*.gz data.cache_dir=/data/shards
        config: experiment YAML whose data section names the raw files (source criteo or avazu), or a shipped name
        tasks: tasks (TorchX replicas; on Slurm, heterogeneous job components, which Slurm puts on different nodes)
        procs_per_task: processes per task, each preprocessing its own part (more parts than files leaves some idle)
        cpu: CPU cores per task (each process parses with threads over the cores it has)
        memMB: memory per task in MB
        max_retries: scheduler retries after a failure (a retried task reuses the parts already written)
        name: job name
        python: Python interpreter on the nodes; empty: the one running this component
    """
    if tasks < 1 or procs_per_task < 1 or cpu < 1 or memMB < 1024 or max_retries < 0:
        raise LaunchError("preprocess: --tasks, --procs_per_task and --cpu must be >= 1, --memMB >= 1024 and --max_retries >= 0")
    from recsys.config import ConfigError, load_config
    from recsys.data.source import raw_files

    try:
        cfg = load_config(config, list(overrides))
        if cfg.data.source == "synthetic":
            raise ConfigError(f"{config}: key 'data.source': generated data (synthetic) has nothing to preprocess")
        raw_files(cfg)  # the files exist (on a cluster: the submit host sees the shared filesystem)
    except ConfigError as e:
        raise LaunchError(str(e).replace("\n", " ")) from None
    python = python or sys.executable
    return specs.AppDef(
        name=name,
        roles=[
            specs.Role(
                name="preprocess",
                image=REPO,
                entrypoint=python,
                args=[
                    "-m",
                    "recsys.cli",
                    "preprocess",
                    "--config",
                    config,
                    "--task",
                    macros.replica_id,
                    "--tasks",
                    str(tasks),
                    "--procs",
                    str(procs_per_task),
                    *overrides,
                ],
                num_replicas=tasks,
                resource=specs.Resource(cpu=cpu, gpu=0, memMB=memMB),
                env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(max(1, cpu // procs_per_task))},
                max_retries=max_retries,
            )
        ],
    )
