"""Builds the fused CowClip-Adam C++ op when the package is installed (wheel, ``pip install .`` and
editable installs alike), so no process pays a JIT build at first use.

All project metadata lives in ``pyproject.toml``; this file only declares the extension, because a
torch ``CppExtension`` needs torch's build helpers at build time (``--no-build-isolation`` in the
Makefile and docs/install.md builds with the torch already installed instead of downloading one).

One build serves every torch of the supported range and every Python: the op uses only LibTorch's
stable ABI (``torch/csrc/stable``: the C shim, no ATen, no Python.h) and is compiled with
``TORCH_TARGET_VERSION`` = 2.11, so the library links to no C++ symbol of torch and loads on torch
2.11 and later; nothing in it uses the Python C API, so the wheel is tagged ``cp311-abi3``
(``py_limited_api``): one file for Python 3.11, 3.12 and 3.13.

The op is ``recsys/optim/_cowclip_C*.so``. It registers ``torch.ops.recsys.*`` when
``recsys.optim.cowclip.kernels.cpp_op`` loads it with ``torch.ops.load_library`` (it is not a Python
module). Next to it goes ``_cowclip_C.sha256``, the hash of the C++ source it was built from: the
loader uses the compiled op only while that matches the shipped source (an editable install whose
source changed falls back to the JIT build instead of running stale code).

Compile flags are those of the JIT build (``recsys/optim/cowclip/kernels/cpp_op.py``: ``CXX_FLAGS``), plus ``-fno-wrapv``
(CPython's own CFLAGS, which setuptools puts first, carry ``-fwrapv``, which would forbid some loop
optimisations the JIT build gets) and ``-g0`` (no debug info in the installed library).

Building leaves the source tree as it was: setuptools' ``build/`` and ``*.egg-info`` go to a
temporary directory outside it (removed when the build ends). Only an editable install writes into
the tree, by design: the op next to its sources (ignored by git).
"""

from __future__ import annotations

import atexit
import hashlib
import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

SOURCE = "recsys/optim/csrc/cowclip_adam.cpp"
EXT_NAME = "recsys.optim._cowclip_C"
HASH_FILE = "_cowclip_C.sha256"
# Keep in sync with recsys/optim/cowclip/kernels/cpp_op.py (CXX_FLAGS, LD_FLAGS); tests/integration/packaging/test_wheel.py checks.
# TORCH_TARGET_VERSION 2.11 (0x020b...): only stable-ABI calls that torch 2.11 already has.
CXX_FLAGS = ["-O3", "-DNDEBUG", "-fno-math-errno", "-DTORCH_TARGET_VERSION=0x020b000000000000"]
LD_FLAGS: list[str] = []
# The oldest CPython whose stable ABI (abi3) the wheel is tagged with.
PY_LIMITED_API = "cp311"


def source_sha256() -> str:
    return hashlib.sha256((Path(__file__).resolve().parent / SOURCE).read_bytes()).hexdigest()


class BuildWithSourceHash(BuildExtension):
    """BuildExtension that also writes the source hash next to the built library (in the build tree
    and, for editable installs, next to the in-place copy)."""

    def run(self) -> None:
        super().run()
        digest = source_sha256() + "\n"
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            fullname = self.get_ext_fullname(ext.name)
            targets = {(Path(self.build_lib) / self.get_ext_filename(fullname)).parent}
            if self.inplace:
                targets.add(Path(build_py.get_package_dir(fullname.rpartition(".")[0])))
            for d in targets:
                if d.is_dir():
                    (d / HASH_FILE).write_text(digest)


def scratch_dir() -> str:
    """A build directory outside the source tree, removed when the build process ends."""
    d = tempfile.mkdtemp(prefix="torchrec-cowclip-trainer-build-")
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


_scratch = scratch_dir()

setup(
    ext_modules=[
        CppExtension(
            EXT_NAME,
            [SOURCE],
            extra_compile_args={"cxx": CXX_FLAGS + ["-fno-wrapv", "-g0"]},
            extra_link_args=LD_FLAGS,
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": BuildWithSourceHash},
    options={
        "bdist_wheel": {"py_limited_api": PY_LIMITED_API},
        "build": {"build_base": str(Path(_scratch) / "build")},
        "egg_info": {"egg_base": _scratch},
    },
)
