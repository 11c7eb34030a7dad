"""What `recsys-plan` reads and writes (recsys/plan_inputs.py): a model from `package.module:factory`
and the one-line refusals of a bad one, capacities from the command line, an `nvidia-smi topo -m`
text imported next to the plan, and output written atomically (an existing file kept on failure)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys.plan_inputs import (
    UsageError,
    check_capacity,
    emit,
    factory_inputs,
    factory_model,
    is_factory,
    load_cluster,
    tables_of,
    topology_file_of,
    write_atomic,
    writing,
)

GiB = 1024**3


class _Tables(nn.Module):
    """Two tables: 10 x 4 and 30 x 8."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="small", embedding_dim=4, num_embeddings=10, feature_names=["f0"]),
                EmbeddingBagConfig(name="large", embedding_dim=8, num_embeddings=30, feature_names=["f1"]),
            ],
            device=torch.device("meta"),
        )


@pytest.fixture
def user_models(monkeypatch):
    """A user's module `user_models` with factories good and bad, importable by name."""
    built_on = []

    def tables():
        built_on.append(torch.empty(0).device.type)  # the device factory() is called under
        return _Tables()

    def needs_real_tensors():
        if torch.empty(0).device.type == "meta":
            raise RuntimeError("cannot load weights on meta")
        return _Tables()

    def broken():
        raise KeyError("weights.pt")

    mod = types.ModuleType("user_models")
    mod.tables, mod.needs_real_tensors, mod.broken = tables, needs_real_tensors, broken
    mod.dense_only = lambda: nn.Linear(2, 2)
    mod.not_a_model = lambda: "a string"
    mod.NOT_CALLABLE = 3
    monkeypatch.setitem(sys.modules, "user_models", mod)
    return built_on


@pytest.mark.parametrize(
    "spec, factory",
    [("pkg.models:build", True), ("configs/exp.yaml", False), ("C:/exp.YAML", False), ("c:/x.yml", False), ("smoke", False)],
)
def test_is_factory(spec, factory):
    assert is_factory(spec) is factory


def test_a_factory_model_is_built_on_meta_when_it_can_be(user_models):
    model = factory_model("user_models:tables")
    assert user_models == ["meta"] and isinstance(model, _Tables)
    assert isinstance(factory_model("user_models:needs_real_tensors"), _Tables)  # meta failed: built on the CPU


def test_tables_of_a_factory_model(user_models):
    tables = tables_of("user_models:tables", [])
    assert {name: (t["num_embeddings"], t["embedding_dim"]) for name, t in tables.items()} == {"small": (10, 4), "large": (30, 8)}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module_x:f",
         "--model no_such_module_x:f: cannot import 'no_such_module_x' (ModuleNotFoundError: No module named 'no_such_module_x')"),
        ("user_models:missing", "--model user_models:missing: module 'user_models' has no function 'missing'"),
        ("user_models:NOT_CALLABLE", "--model user_models:NOT_CALLABLE: module 'user_models' has no function 'NOT_CALLABLE'"),
        ("user_models:broken", "--model user_models:broken: broken() raised KeyError: 'weights.pt'"),
        ("user_models:not_a_model", "--model user_models:not_a_model: not_a_model() returned str, not an nn.Module"),
    ],
)  # fmt: skip
def test_a_bad_factory_is_one_line(user_models, spec, message):
    with pytest.raises(UsageError, match="^--model ") as e:
        factory_model(spec)
    assert str(e.value) == message


def test_a_model_without_tables_is_refused(user_models):
    with pytest.raises(
        UsageError, match="^--model user_models:dense_only: the model has no EmbeddingBagCollection / EmbeddingCollection tables$"
    ):
        tables_of("user_models:dense_only", [])


def test_factory_inputs_refuse_config_options_and_set_only_the_topology(user_models):
    args = SimpleNamespace(config="user_models:tables", overrides=["train.batch_size=8"], data_sample="")
    with pytest.raises(
        UsageError, match=r"^--model user_models:tables: --set and --data-sample need an experiment config \(--config FILE.yaml\)$"
    ):
        factory_inputs(args, [])
    args.overrides = []
    cfg, model, sharders = factory_inputs(args, ["sharding.planner=topology", "sharding.topology=cpu-gloo"])
    assert (cfg.sharding.planner, cfg.sharding.topology) == ("topology", "cpu-gloo")
    assert isinstance(model, _Tables) and len(sharders) == 1


@pytest.mark.parametrize("gb, shown", [(None, None), (0.0, None), (0.5, None), (-1.0, "-1"), (-0.25, "-0.25"), (float("nan"), "nan")])
def test_capacities_absent_zero_or_positive_and_typos(gb, shown):
    """0 or absent: the default; a negative or nan size is a typo, refused in one line."""
    if shown is None:
        assert check_capacity("--ddr-gb", gb) is None
        return
    with pytest.raises(UsageError, match=r"GiB > 0") as e:
        check_capacity("--ddr-gb", gb)
    assert str(e.value) == f"--ddr-gb {shown}: expected a size in GiB > 0 (leave it out for the default)"


def test_write_atomic_replaces_and_leaves_no_temp_file(tmp_path, monkeypatch):
    out = tmp_path / "new" / "report.txt"
    write_atomic(out, "one\n")
    write_atomic(out, "two\n")
    assert out.read_text() == "two\n" and [p.name for p in out.parent.iterdir()] == ["report.txt"]

    def full_disk(self, text):
        Path.write_bytes(self, text[:2].encode())  # part of it written, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        write_atomic(out, "three\n")
    assert out.read_bytes() == b"two\n" and [p.name for p in out.parent.iterdir()] == ["report.txt"]


def test_emit_prints_or_writes_one_trailing_newline(tmp_path, capsys):
    emit("a\nb", None)
    assert capsys.readouterr().out == "a\nb\n"
    emit("a\nb", str(tmp_path / "o.txt"))
    emit("c\n", str(tmp_path / "p.txt"))
    assert (tmp_path / "o.txt").read_text() == "a\nb\n" and (tmp_path / "p.txt").read_text() == "c\n"
    assert capsys.readouterr().out == ""


def test_a_failed_write_says_whether_the_previous_file_is_kept(tmp_path):
    old = tmp_path / "plan.json"
    old.write_text("previous")
    with pytest.raises(UsageError, match="unchanged") as e:
        with writing(str(old)):
            raise PermissionError(13, "Permission denied")
    assert str(e.value) == f"cannot write --out {old}: Permission denied; the previous file is unchanged"
    new = tmp_path / "new.json"
    with pytest.raises(UsageError, match="nothing was written") as e:
        with writing(str(new)):
            raise OSError(28, "No space left on device")
    assert str(e.value) == f"cannot write --out {new}: No space left on device; nothing was written"
    with pytest.raises(UsageError, match="is a directory") as e:
        with writing(str(tmp_path)):
            pass
    assert str(e.value) == f"--out {tmp_path} is a directory; give a file name, e.g. {tmp_path / 'plan.json'}"


# two GPUs joined by 4 NVLinks, as `nvidia-smi topo -m` prints them
TOPO_M = "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tNV4\t0-15\t0\nGPU1\tNV4\t X \t0-15\t0\n"


def _topology_args(tmp_path: Path, **kw) -> SimpleNamespace:
    (tmp_path / "topo.txt").write_text(TOPO_M)
    values = dict(
        topology=str(tmp_path / "topo.txt"), gpu="", hbm_gb=0.0, hbm_bw_gb_s=None, ddr_gb=0.0, out=str(tmp_path / "out" / "plan.json")
    )
    return SimpleNamespace(**{**values, **kw})


def test_a_topology_name_or_yaml_is_used_as_given(tmp_path):
    assert topology_file_of(SimpleNamespace(topology="dgx-a100", out=str(tmp_path / "p.json"))) == "dgx-a100"
    assert list(tmp_path.iterdir()) == []


def test_nvidia_smi_text_is_imported_next_to_the_plan_with_the_given_capacities(tmp_path):
    path = topology_file_of(_topology_args(tmp_path, gpu="h100-sxm"))
    assert path == str(tmp_path / "out" / "plan.topology.yaml")
    assert Path(path).read_text().startswith("# imported from topo.txt by recsys-plan make\n")
    topo = load_cluster(path)
    assert (topo.world_size, topo.local_world_size) == (2, 2)
    assert [g.hbm_bytes for g in topo.hosts[0].gpus] == [80 * GiB, 80 * GiB]  # the H100 SXM preset
    topo = load_cluster(topology_file_of(_topology_args(tmp_path, gpu="h100-sxm", hbm_gb=40.0)))
    assert [g.hbm_bytes for g in topo.hosts[0].gpus] == [40 * GiB, 40 * GiB]  # --hbm-gb wins over the preset


def test_nvidia_smi_text_without_a_gpu_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^topo.txt: no GPU model: name it with --gpu"):
        topology_file_of(_topology_args(tmp_path))
    assert not (tmp_path / "out").exists()
