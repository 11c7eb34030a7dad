"""TorchX components for this project (see docs/launch.md): `train`, `plan` and `preprocess` in `launch.py`.

Installed (wheel or `make venv`), they are registered under the `torchx.components` entry point
as `recsys.train`, `recsys.plan` and `recsys.preprocess`, so `torchx builtins` lists them and they run by name from
any directory, e.g. `torchx run -s local_cwd recsys.train --config smoke`. From the repository
root the file path works too: `torchx run -s local_cwd torchx_components/launch.py:train
--config configs/experiments/smoke.yaml`.
"""
