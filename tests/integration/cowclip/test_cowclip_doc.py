"""docs/cowclip.md's Python blocks run as written: each is executed, unchanged, after a preamble
that defines the names it takes from the reader's pipeline (``ebc``, ``ec``, ``model``, ``plan``),
in a one-rank gloo job; then one training step must move every tagged table, and only those."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "cowclip.md"

# what the reader's pipeline has before the block: a model with an EBC (and, for blocks that use
# it, an EC) on the meta device, and for blocks that use `plan`, a plan for the sharders they name
PREAMBLE = """
import os, torch, torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
meta = torch.device("meta")
ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t_bag", embedding_dim=8, num_embeddings=50,
                                                        feature_names=["f_bag"])], device=meta)
ec = EmbeddingCollection(tables=[EmbeddingConfig(name="t_seq", embedding_dim=8, num_embeddings=40,
                                                 feature_names=["f_seq"])], device=meta)

class Model(torch.nn.Module):
    def __init__(self, ebc, ec):
        super().__init__()
        self.ebc, self.ec = ebc, ec

model = Model(ebc, ec)
"""

# the planner's view of the sharders a block will hand DMP (found in the block's text)
PLAN = """
from sharding import TopologyAwarePlanner
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from recsys import CowClipEmbeddingBagCollectionSharder, CowClipEmbeddingCollectionSharder
plan = TopologyAwarePlanner("cpu-gloo", batch_size=8).collective_plan(
    model, [CowClipEmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()])
"""

# after the block: DMP (if the block did not build it), one step, and which tables moved
CHECK = """
if "dmp" not in globals():
    dmp = DistributedModelParallel(model, sharders=sharders, device=torch.device("cpu"))
def weights():  # table -> this rank's copy (the whole table: one rank)
    local = lambda v: v.local_shards()[0].tensor if hasattr(v, "local_shards") else v
    return {k.split(".")[-2]: local(v).detach().clone() for k, v in dmp.state_dict().items() if k.endswith(".weight")}
before = weights()
kjt = lambda f, ids: KeyedJaggedTensor.from_lengths_sync(keys=[f], values=torch.tensor(ids),
                                                         lengths=torch.tensor([2, 1, 2]))
pooled = dmp.module.ebc(kjt("f_bag", [1, 2, 3, 4, 5]))
loss = pooled.values().square().sum()
if USES_EC:
    loss = loss + dmp.module.ec(kjt("f_seq", [1, 1, 2, 3, 4]))["f_seq"].values().square().sum()
loss.backward()
after = weights()
print("MOVED", sorted(n for n in before if not torch.equal(before[n], after[n])))
dist.destroy_process_group()
"""


def python_blocks() -> list[tuple[int, str]]:
    text = DOC.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


def test_the_doc_has_python_blocks():
    assert len(python_blocks()) >= 2


@pytest.mark.parametrize("line, block", python_blocks(), ids=[f"line{n}" for n, _ in python_blocks()])
def test_block_runs_as_written_and_trains_the_tables_it_tags(tmp_path, line, block):
    from recsys.training.distributed import free_port

    uses_ec = "ec." in block or "ec)" in block
    pre = PREAMBLE + f"USES_EC = {uses_ec}\n" + ("" if uses_ec else "model = Model(ebc, torch.nn.Identity())\n")
    script = pre + (PLAN if re.search(r"\bplan\b", block) else "") + "\n# ---- the block\n" + block + "\n" + CHECK
    path = tmp_path / "block.py"
    path.write_text(script)
    r = subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**__import__("os").environ, "PORT": str(free_port()), "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, f"docs/cowclip.md line {line}: the block fails:\n{r.stderr[-3000:]}"
    moved = re.search(r"^MOVED (.*)$", r.stdout, re.M)
    assert moved, r.stdout[-2000:]
    want = ["t_bag", "t_seq"] if uses_ec else ["t_bag"]
    assert eval(moved.group(1)) == want, textwrap.shorten(r.stdout, 500)
