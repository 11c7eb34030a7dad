"""What `recsys-plan` reads and writes, apart from its commands (recsys/plan_cli.py): the model
and its tables from an experiment YAML or a ``package.module:factory``, a plan file read and
validated, a topology by name, file or ``nvidia-smi topo -m`` text, capacities given on the
command line, and output written atomically (an existing file is left as it was on any error)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from recsys.config import load_config


class UsageError(ValueError):
    pass


def model_and_tables(config: str, overrides: list[str]):
    import torch

    from recsys.data.source import build_source
    from recsys.models.ctr import TrainModule
    from recsys.optim.embedding import attach_embedding_optimizer
    from recsys.training.job import default_model
    import sharding.plan.io as plan_io

    cfg = load_config(config, overrides)
    model = TrainModule(default_model(cfg, build_source(cfg), torch.device("cpu")))
    attach_embedding_optimizer(model, cfg.optim)
    return cfg, model, plan_io.model_tables(model)


def is_factory(spec: str) -> bool:
    """``package.module:factory`` (a Python factory), not a YAML path."""
    return ":" in spec and not spec.lower().endswith((".yaml", ".yml"))


def factory_model(spec: str):
    """Import ``package.module`` and call ``factory()``, on the meta device when it builds there."""
    import importlib

    import torch
    from torch import nn

    mod_name, _, fn_name = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:  # console script: find the user's modules as `python -m` does
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:
        raise UsageError(
            f"--model {spec}: cannot import '{mod_name}' ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    factory = getattr(module, fn_name, None)
    if not callable(factory):
        raise UsageError(f"--model {spec}: module '{mod_name}' has no function '{fn_name}'")
    try:
        with torch.device("meta"):
            model = factory()
    except Exception:  # some models cannot be built on meta (e.g. they read their weights): build on CPU
        try:
            model = factory()
        except Exception as e:
            raise UsageError(f"--model {spec}: {fn_name}() raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {spec}: {fn_name}() returned {type(model).__name__}, not an nn.Module")
    return model


def tables_of(spec: str, overrides: list[str]) -> dict[str, dict]:
    """The tables (shapes, data types, optimizer state) of a model given as YAML or module:factory."""
    import sharding.plan.io as plan_io

    if is_factory(spec):
        tables = plan_io.model_tables(factory_model(spec))
        if not tables:
            raise UsageError(f"--model {spec}: the model has no EmbeddingBagCollection / EmbeddingCollection tables")
        return tables
    return model_and_tables(spec, overrides)[2]


def read_valid(path: str, model: str | None = None, overrides: list[str] | None = None):
    """A plan file, validated (PlanFileError on the first problem); with a model, checked to be
    for it and reported with its tables' data types and optimizer state."""
    import sharding.plan.io as plan_io
    from sharding.plan.validation import validate_plan

    plan, header = plan_io.read_plan_file(path)
    validate_plan(plan, header, str(path))
    if model:
        tables = tables_of(model, overrides or [])
        plan_io.check_plan_fits(header, plan, tables, header["world_size"], str(path))
        header["tables"] = tables
    return plan, header


def write_atomic(path: Path, text: str) -> None:
    """Temp file + rename; on any failure (a full disk) the temp file is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def emit(text: str, out: str | None) -> None:
    if out:
        with writing(out):
            write_atomic(Path(out), text if text.endswith("\n") else text + "\n")
    else:
        print(text)


@contextlib.contextmanager
def writing(out: str):
    """A failed write of --out (a directory, a full disk, no permission) as one line; the atomic
    writers leave the previous file as it was and no temp file behind."""
    if Path(out).is_dir():
        raise UsageError(f"--out {out} is a directory; give a file name, e.g. {Path(out) / 'plan.json'}")
    existed = Path(out).exists()
    try:
        yield
    except OSError as e:
        kept = "the previous file is unchanged" if existed else "nothing was written"
        raise UsageError(f"cannot write --out {out}: {e.strerror or e}; {kept}") from None


def check_capacity(option: str, gb: float | None) -> None:
    """--hbm-gb / --ddr-gb: 0 (or absent) means the default; a negative size is a typo."""
    if gb is not None and (gb < 0 or gb != gb):
        raise UsageError(f"{option} {gb:g}: expected a size in GiB > 0 (leave it out for the default)")


def load_cluster(name: str):
    from sharding.topology.topology_file import load_topology

    return load_topology(name)


def topology_file_of(args: argparse.Namespace) -> str:
    """A topology YAML or shipped name as is; an `nvidia-smi topo -m` text (.txt) is imported with
    the capacities given on the command line and written next to the plan as <out>.topology.yaml."""
    if not args.topology.endswith(".txt"):
        return args.topology
    from sharding.topology.topology_dump import dump_topology
    from sharding.topology.nvidia_smi import import_topo

    # the GPU's capacities: from --gpu's preset (or `nvidia-smi -L` lines in the file), each
    # overridden by an explicit --hbm-gb / --hbm-bw-gb-s; an unknown GPU without them is an error
    caps: dict = {"gpu_model": args.gpu} if args.gpu else {}
    if args.hbm_gb:
        caps["hbm_gb"] = args.hbm_gb
    if args.hbm_bw_gb_s:
        caps["hbm_bw_gb_s"] = args.hbm_bw_gb_s
    if args.ddr_gb:
        caps["ddr_gb"] = args.ddr_gb
    topo = import_topo(args.topology, **caps)
    path = Path(args.out).with_suffix(".topology.yaml")
    write_atomic(path, dump_topology(topo, header=f"imported from {Path(args.topology).name} by recsys-plan make"))
    return str(path)


def factory_inputs(args: argparse.Namespace, overrides: list[str]):
    """Config defaults, the user's model and the sharders its tables need (CowClip-Adam tables:
    the project's sharder; others: torchrec's)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from recsys.config import ExperimentConfig
    from recsys.optim.cowclip.sharder import CowClipEmbeddingBagCollectionSharder
    from sharding.optimizer_state import table_optimizers

    if args.overrides or args.data_sample:
        raise UsageError(f"--model {args.config}: --set and --data-sample need an experiment config (--config FILE.yaml)")
    cfg = ExperimentConfig()
    for o in overrides:  # only the topology-aware planner's, set by --topology
        key, _, value = o.partition("=")
        setattr(cfg.sharding, key.split(".", 1)[1], value)
    model = factory_model(args.config)
    kinds = set(table_optimizers(model).values())
    if not kinds:
        raise UsageError(f"--model {args.config}: the model has no EmbeddingBagCollection / EmbeddingCollection tables")
    sharder = CowClipEmbeddingBagCollectionSharder() if "cowclip_adam" in kinds else EmbeddingBagCollectionSharder()
    return cfg, model, [sharder]
