"""The experiment config's schema: one dataclass per section, string options as Literal types,
and the table-size presets. What each key means is said next to it; recsys/config/loading.py
reads files into it and recsys/config/checks.py rejects impossible values."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Union


class ConfigError(ValueError):
    """A bad configuration; the message is one line that names the file and key."""


# The options a string key takes: checked when a file or override sets them (``_coerce``) and
# again by ``validate`` for configs built in Python.
ModelName = Literal["deepfm", "wide_deep", "dcn", "dcnv2"]
DataSource = Literal["synthetic", "criteo", "avazu"]
EmbeddingOptimizer = Literal["rowwise_adagrad", "adagrad", "sgd", "cowclip_adam", "adam", "fbgemm_cowclip"]


@dataclass
class ModelConfig:
    """Model architecture. Defaults follow the CowClip paper (DNN 400-400-400) except the
    embedding dim: the paper uses 10, FBGEMM's fused kernels need dims divisible by 4, so 16."""

    name: ModelName = "deepfm"  # the CTR model (recsys/models/ctr.py)
    embedding_dim: int = 16  # every sparse feature's embedding width (FBGEMM kernels: a multiple of 4)
    dnn: list[int] = field(default_factory=lambda: [400, 400, 400])  # hidden layer widths of the deep part
    cross_layers: int = 3  # dcn / dcnv2
    cross_low_rank: int = 0  # dcnv2: 0 = full-rank matrix cross layers
    dropout: float = 0.0  # dropout of the deep part's hidden layers, in [0, 1)
    # Embedding rows start uniform with this standard deviation (CowClip reference: 1e-2).
    embedding_init_std: float = 0.01
    # Tables get this many times the data's cardinality in rows; the ids stay in the first part
    # (headroom, as hashed tables sized for future ids have). 1: the cardinality.
    table_rows_factor: int = 1


@dataclass
class DataConfig:
    """Where batches come from. `synthetic` is the embedded default (no files needed)."""

    source: DataSource = "synthetic"  # synthetic (generated, no files) | criteo | avazu (raw files at data.path)
    # criteo/avazu: raw files (a file, a directory or a glob); preprocessed once into cache_dir.
    path: str = ""
    format: Literal["auto", "tsv", "csv"] = "auto"  # criteo
    cache_dir: str = ""  # default: data_cache/<source>-<name of path>-<hash of its absolute path> (docs/data.md)
    eval_fraction: float = 0.1  # criteo/avazu: the last fraction of rows is the eval split
    max_bad_fraction: float = 0.01  # preprocessing stops, writing nothing, when more of a file's rows are malformed
    # How a shard cache that matches its inputs' names, sizes, mtimes and first/last MiB is checked
    # before reuse: full (every byte hashed again, ~0.7 s/GB) | quick (trust those; said in the log)
    verify: Literal["full", "quick"] = "full"
    # Training epochs in a seeded, shuffled order (recsys/data/order.py, docs/data.md): blocks of
    # shuffle_block_rows consecutive rows permuted per epoch, rows permuted again inside windows
    # of shuffle_buffer_rows (0: blocks only). Eval always reads its split in order.
    shuffle: bool = True
    shuffle_seed: int = 0  # the epoch order's seed
    shuffle_block_rows: int = 256  # rows kept together (read sequentially) in the shuffled order
    shuffle_buffer_rows: int = 65536  # window in which rows are permuted again; 0: blocks only
    # Table sizes: a preset name or an explicit list (raw ids are hashed into these sizes).
    cardinalities: Union[str, list[int]] = "criteo_kaggle_filtered"
    # synthetic source
    train_rows: int = 1_000_000  # rows per epoch
    eval_rows: int = 100_000  # synthetic eval rows
    seed: int = 0  # the generator's seed (the teacher and the rows)
    zipf_exponent: float = 1.05  # id popularity ~ rank^-a per field: how skewed the lookups are
    teacher_head: int = 200  # ids (by popularity rank) per field that carry signal
    teacher_dim: int = 4  # width of the hidden teacher's pairwise (FM) factors
    teacher_scale: float = 1.0  # scales the teacher's weights: more signal, a higher reachable AUC
    positive_rate: float = 0.25  # share of clicks (label 1) the teacher is calibrated to


@dataclass
class OptimConfig:
    """Optimizers: embeddings are updated inside the backward (FBGEMM fused); dense by Adam."""

    # rowwise_adagrad | adagrad | sgd (FBGEMM fused); cowclip_adam | adam (our fused kernel,
    # recsys/optim/cowclip/sharder.py); fbgemm_cowclip (FBGEMM's native COWCLIP on rowwise Adagrad)
    embedding: EmbeddingOptimizer = "rowwise_adagrad"
    embedding_lr: float = 0.005  # learning rate of the embedding optimizer (applied inside the backward)
    embedding_eps: float = 1e-8  # epsilon of the embedding optimizer (Adam / Adagrad)
    dense_lr: float = 1e-3  # Adam learning rate of the dense parameters (and data_parallel tables)
    dense_weight_decay: float = 0.0  # torch.optim.Adam weight_decay of the dense parameters
    # CowClip (paper: r=1, zeta=1e-5; the wide/linear tables unclipped; L2 lambda on embedding rows)
    cowclip_r: float = 1.0
    cowclip_zeta: float = 1e-5  # floor of the clip threshold: r * count * max(||w||, r * sqrt(dim) * zeta)
    cowclip_wide: bool = False  # also clip the wide/linear tables
    embedding_l2: float = 0.0  # Keras l2(lambda) (cowclip_adam/adam/fbgemm_cowclip)
    # auto (effective_l2_scope): catchup for cowclip_adam, batch otherwise | batch: rows of the batch
    # only (lazy) | all: every row, every step | catchup: as all, absent rows advanced when next read
    embedding_l2_scope: Literal["auto", "batch", "all", "catchup"] = "auto"
    adam_beta1: float = 0.9  # Adam beta1 of the embedding kernels (cowclip_adam, adam)
    adam_beta2: float = 0.999  # Adam beta2 of the embedding kernels
    adam_eps_mode: Literal["torch", "keras"] = "torch"  # torch.optim.Adam's eps | the paper's tf.keras Adam's
    # Scaling rule (recsys/optim/scaling.py): hyperparameters above are for batch `scale_from_batch`;
    # the run's train.batch_size scales them (0: off). cowclip: embedding lr x1, L2 x s, dense lr
    # x sqrt(s); sqrt / linear: every lr x sqrt(s) / x s.
    scale_from_batch: int = 0
    scale_rule: Literal["cowclip", "sqrt", "linear"] = "cowclip"  # which rule scale_from_batch applies
    warmup_epochs: float = -1.0  # linear dense-lr warmup; -1: 1 epoch when scaling, else none


# What optim.embedding_l2_scope=auto (the default) is for each embedding kernel. CowClip-Adam: the
# reference's semantics by catch-up (bytedance/LargeBatchCTR's dense L2 + Adam, at lazy cost): in
# the paper-scale grid it beat the lazy semantics at batch 1K (final AUC +0.0109: lazy Adam
# overfits) and at 128K (+0.0014, and in every epoch), and the lazy semantics never clip
# (docs/large_batch.md). Plain Adam: lazy, as FBGEMM's and TorchRec's fused Adam. FBGEMM's
# optimizers have no such choice ("batch").
AUTO_L2_SCOPE = {"cowclip_adam": "catchup"}


def effective_l2_scope(o: "OptimConfig") -> str:
    """The embedding update scope a run trains with: ``o.embedding_l2_scope`` with ``auto`` resolved
    (``AUTO_L2_SCOPE``). The kernels and the checkpoint's state shape both read it from here."""
    if o.embedding_l2_scope != "auto":
        return o.embedding_l2_scope
    return AUTO_L2_SCOPE.get(o.embedding, "batch")


@dataclass
class TrainConfig:
    """The run: batch, length, processes, device, logging and evals, and hierarchical (k-step)
    training across hosts."""

    batch_size: int = 1024  # global batch; each rank gets batch_size / world_size rows
    epochs: int = 1  # passes over the training split (unless max_steps is set)
    max_steps: int = 0  # 0: run `epochs` epochs
    eval_every: int = 0  # steps between evals; 0: only at the end
    eval_batch_size: int = 8192  # global batch of the evals (a multiple of the world size)
    log_every: int = 20  # steps between progress lines and metrics.jsonl records
    nproc_per_node: int = 2  # processes (ranks) `recsys train` starts on this host
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when a GPU is visible (NCCL), else CPU (gloo)
    seed: int = 0  # torch seed: model initialisation
    threads_per_rank: int = 0  # 0: cores / local ranks
    # The dense part of a training step (everything after the embedding lookups, and the loss) runs
    # in chunks of this many rows when a rank's batch is larger: same gradients, one embedding
    # update per batch, activations that stay in cache (recsys/models/micro_batch.py). 0: whole batches.
    micro_batch_rows: int = 8192
    # Hierarchical (k-step merge) training, docs/kstep.md. hosts: how many hosts the world is
    # split into (host-major ranks; 1 = plain synchronous training). Under torchrun a value of
    # 1 with merge_every > 0 takes the host count from NNODES / GROUP_WORLD_SIZE.
    hosts: int = 1
    merge_every: int = 0  # k: average dense params and embedding shards across hosts every k steps; 0: off
    merge_moments: bool = False  # also average optimizer state (Adam moments, Adagrad momentum)
    merge_route: Literal["auto", "flat", "hierarchical"] = "auto"  # auto: hierarchical when a host has > 1 rank
    # which embedding rows a merge averages: touched (rows some host looked up since the last
    # merge; the others are equal everywhere already) | all (whole shards)
    merge_rows: Literal["touched", "all"] = "touched"
    # the parameters' outer step at a merge (recsys/training/kstep/outer.py): average (plain
    # averaging) | nesterov (DiLoCo, arXiv 2311.08105: delta = anchor - average, m <- momentum*m + delta,
    # theta <- anchor - lr*(delta + momentum*m); the anchor: the model right after the last merge)
    merge_outer: Literal["average", "nesterov"] = "average"
    merge_outer_lr: float = 0.7  # DiLoCo's outer lr; 1 with momentum 0: plain averaging
    merge_outer_momentum: float = 0.9  # DiLoCo's outer Nesterov momentum, in [0, 1)
    # bf16: parameters travel as bf16 deltas from the last merge with error feedback (half the
    # bytes of the parameters; merged moments stay in their dtype) | none: fp32 values
    merge_compress: Literal["none", "bf16"] = "none"
    pg_timeout_s: float = 600.0  # collective timeout of hierarchical runs: a lost host stops the job
    # Outputs that need the [viz] extra (tensorboard, matplotlib): TensorBoard events in
    # <run_dir>/tb and the picture <run_dir>/curves.png. metrics.jsonl and summary.json are always written.
    tensorboard: bool = True
    curves: bool = True  # write <run_dir>/curves.png at the end (needs matplotlib)


@dataclass
class ShardingConfig:
    """How the tables are placed on the ranks: the planner, the hardware it plans for, and what it
    may use (docs/topology.md). `plan` (top level) skips planning."""

    # torchrec: torchrec's EmbeddingShardingPlanner; topology: sharding/planner/topology_planner.py
    planner: Literal["torchrec", "topology"] = "torchrec"
    topology: str = ""  # planner=topology: a topology file or shipped name (CPU runs default to cpu-gloo)
    # Sharding types the planner may use. Empty: the model-parallel ones (TW, RW, CW, TWRW,
    # TWCW). data_parallel tables are updated by the dense optimizer, so they are opt-in.
    sharding_types: list[str] = field(default_factory=list)
    # UVM cache sizing from data (sharding/planner/cache_sizing.py): a JSON id histogram, a shard directory,
    # synthetic:N or data:N; each cached table gets the smallest load factor reaching target_hit_rate
    data_sample: str = ""
    target_hit_rate: float = 0.95  # the UVM cache hit rate data_sample sizing aims at, in (0, 1]


@dataclass
class CheckpointConfig:
    """Atomic DCP checkpoints in <run_dir>/checkpoints (docs/run_integrity.md); the last step
    always writes one."""

    every_steps: int = 0  # 0: only at the end
    keep: int = 2  # complete checkpoints kept; older ones are deleted after a new one commits


@dataclass
class ExperimentConfig:
    name: str = "experiment"  # names the run; its directory defaults to runs/<name>
    run_dir: str = ""  # default: runs/<name>
    resume: bool = False  # continue from the newest complete checkpoint in run_dir (RECSYS_RESUME=1 sets it)
    # Resume on other data than the checkpoint trained on (fine-tuning): its epochs count from the
    # checkpoint's step. Without it such a resume stops with one line saying what changed.
    resume_on_new_data: bool = False
    # Fresh run in a run_dir that has checkpoints: move the old run aside (without it such a run stops).
    overwrite: bool = False
    # A saved plan file (sharding/plan/io.py; `recsys-plan`) to use instead of planning.
    plan: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir or os.path.join("runs", self.name))


# Table-size presets (Criteo Kaggle C1..C26; see docs/data.md for where they come from).
CARDINALITY_PRESETS: dict[str, list[int]] = {
    "criteo_kaggle_filtered": [
        1446, 554, 157339, 117822, 306, 18, 11882, 630, 5, 39530, 5131, 156656, 3176, 28, 11043,
        148913, 12, 4560, 2003, 5, 154564, 18, 17, 53031, 82, 40955,
    ],
    "criteo_kaggle_raw": [
        1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
    ],
    "criteo_1tb": [
        45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10,
        2209, 11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35,
    ],
    # Avazu's 22 categorical fields hashed into tables sized after its vocabularies (min count 2).
    "avazu": [
        240, 7, 7, 4737, 7745, 26, 8552, 559, 36, 2686408, 6729486, 8251, 5, 4, 2626, 8, 9, 435,
        4, 68, 172, 60,
    ],
}  # fmt: skip


def cardinalities(data: DataConfig) -> list[int]:
    """The table sizes a data config asks for."""
    if isinstance(data.cardinalities, str):
        return list(CARDINALITY_PRESETS[data.cardinalities])
    return list(data.cardinalities)
