# The two commands a newcomer needs: `make demo` and `make test` (see README.md).
# Both create .venv inside the repo if missing and install the pinned CPU stack (constraints.txt).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
# The stamp's name changes whenever the pins, the project metadata or the C++ op's source change, so
# the venv is refreshed (and the op, built by `pip install -e .` through setup.py, rebuilt).
STAMP := $(VENV)/.installed-$(shell cat constraints.txt pyproject.toml setup.py recsys/optim/csrc/* | sha1sum | cut -c1-12)
PIP := $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt

.PHONY: venv test-deps demo lint test test-unit test-system test-gpu test-stacks wheel ci bench clean reference
venv: $(STAMP)

# Test-only dependencies: triton's interpreter (TRITON_INTERPRET=1) runs the CUDA CowClip kernel on
# CPU tensors in tests/integration/cowclip/kernels/test_triton_*.py (a ~290 MB wheel, 1 GB installed, so not
# part of `make demo`), and ruff for `make lint`.
TEST_STAMP := $(VENV)/.test-deps-$(shell grep -E '^(triton|ruff)=' constraints.txt | sha1sum | cut -c1-8)
test-deps: $(TEST_STAMP)
$(TEST_STAMP): $(STAMP)
	$(PIP) triton ruff
	@rm -f $(VENV)/.test-deps-* && touch $@

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing the pinned CPU stack into $(VENV) (torch 2.13.0+cpu, fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0, every extra)"
	$(PIP) setuptools "torch==2.13.0+cpu" fbgemm-gpu-cpu tensordict torchmetrics tqdm pyre-extensions iopath numpy PyYAML tensorboard pytest pytest-xdist matplotlib ninja
	@# torchrec declares a dependency on the CUDA fbgemm-gpu, which breaks `import torchrec` on CPU torch.
	$(PIP) --no-deps torchrec
	@# The [launch] extra, TorchX (docs/launch.md): the pinned nightly. Never also `torchx` (the same module).
	$(PIP) torchx-nightly
	@# The distribution was called `recsys` before it became torchrec-cowclip-trainer: drop the old one.
	@$(PY) -m pip uninstall -q -y recsys >/dev/null 2>&1 || true
	@# Builds the CowClip C++ op (setup.py, ~10 s) with the torch above instead of downloading one.
	$(PIP) --no-deps --no-build-isolation -e .
	@$(PY) -c "import torchrec, fbgemm_gpu, recsys; print('stack ok: torch', __import__('torch').__version__, 'torchrec', torchrec.__version__)"
	@$(PY) -c "import recsys.optim.cowclip.kernels.cpp_op as k; k.load_extension(require=True); print('CowClip op:', k.fallback_reason())"
	@rm -f $(VENV)/.installed-* && touch $@

demo: venv
	$(VENV)/bin/recsys train --config configs/experiments/demo.yaml

# The tiers are directories (tests/conftest.py): unit, integration, system, gpu. `make test` runs the
# unit and integration tiers in parallel (pytest-xdist, one worker per core, a test file's tests on
# one worker so module fixtures are built once); `make test-system` runs the system tier one test at
# a time (root, network namespaces, Slurm, Chromium, cross-host timeouts) and the GPU tier (skipped
# without a CUDA device). pytest exits 5 when it collects no tests; that is not a failure of the
# suite. The 40 slowest tests are listed at the end (where the suite's time goes).
XDIST ?= -n 2 --dist loadfile

# ruff (pyproject.toml [tool.ruff]): the lint rules (pycodestyle, pyflakes, bugbear) and the format.
# `$(VENV)/bin/ruff format .` fixes the format; CI runs this first.
# the generated reference pages (docs/reference/): rewrite them after changing a config key or a CLI option
reference: venv
	$(VENV)/bin/python tools/ci/gen_reference.py

lint: venv test-deps
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

test: venv test-deps
	$(VENV)/bin/pytest -q $(XDIST) --durations=40 tests/unit tests/integration || [ $$? -eq 5 ]

test-unit: venv test-deps
	$(VENV)/bin/pytest -q tests/unit || [ $$? -eq 5 ]

test-system: venv test-deps
	$(VENV)/bin/pytest -q --durations=20 tests/system tests/gpu || [ $$? -eq 5 ]

# The GPU suite (tests/gpu; docs/install.md "Testing on a GPU"): NCCL, FBGEMM's CUDA kernels, the
# Triton kernel compiled, a training run on CUDA. It needs a CUDA build of the stack, e.g.
# `make test-gpu GPU_VENV=.venv-cuda`; with the CPU stack of $(VENV) (and in `make test-system`, which
# collects tests/gpu too) every test is skipped with one reason line.
GPU_VENV ?= $(VENV)
test-gpu: $(if $(filter $(GPU_VENV),$(VENV)),venv test-deps)
	$(GPU_VENV)/bin/pytest -ra tests/gpu

# The wheel: one file for Python 3.11-3.13 and torch 2.11-2.14 (cp311-abi3; the CowClip op on torch's
# stable ABI). Built outside the source tree (setup.py), written to $(WHEEL_DIR).
WHEEL_DIR ?= runs/wheel
wheel: venv
	@rm -rf $(WHEEL_DIR) && mkdir -p $(WHEEL_DIR)
	$(PY) -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w $(WHEEL_DIR) .

# The supported range's ends (CI): that wheel, installed with pip into a venv per stack
# (constraints.txt, constraints-oldest.txt, constraints-newest.txt; built once, outside the
# repository, in $$RECSYS_STACKS or ~/.cache/recsys/stacks), trains, plans and passes the drop-in
# test there (tools/ci/stack_tier.sh). Every stack runs even when one fails.
STACKS ?= default oldest newest
test-stacks: wheel
	@rc=0; for s in $(STACKS); do bash tools/ci/stack_tier.sh $$s $(WHEEL_DIR)/*.whl || rc=1; done; exit $$rc

# What CI runs (.ci/run): every tier, each with its time: `make lint`, `make test`,
# `make test-system`, then `make test-stacks`.
ci:
	@t0=$$(date +%s) && $(MAKE) lint && echo "CI tier: lint (ruff check + format): $$(($$(date +%s) - t0)) s"
	@t0=$$(date +%s) && $(MAKE) test && echo "CI tier: unit + integration (default stack, parallel): $$(($$(date +%s) - t0)) s"
	@t0=$$(date +%s) && $(MAKE) test-system && echo "CI tier: system + gpu (default stack): $$(($$(date +%s) - t0)) s"
	@t0=$$(date +%s) && $(MAKE) test-stacks && echo "CI tier: stacks ($(STACKS)): $$(($$(date +%s) - t0)) s"

# The benchmark's reference, DeepCTR-Torch, is installed without its deps so it cannot replace torch.
bench: venv
	$(PIP) --no-deps deepctr-torch==0.3.0 && $(PIP) scikit-learn
	$(PY) tools/bench/train.py --out runs/bench_train.json

clean:
	rm -rf $(VENV) runs data_cache
