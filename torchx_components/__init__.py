"""TorchX components for this project (see docs/launch.md).

Run them by file path from the repository root, e.g.
`torchx run -s local_cwd torchx_components/launch.py:train --config configs/experiments/smoke.yaml`.
"""
