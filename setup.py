"""Builds the fused CowClip-Adam C++ op when the package is installed (wheel, ``pip install .`` and
editable installs alike), so no process pays a ~1 min JIT build at first use.

All project metadata lives in ``pyproject.toml``; this file only declares the extension, because a
torch ``CppExtension`` needs torch's build helpers at build time (hence ``--no-build-isolation``
in the Makefile and docs/install.md: the extension must be built against the torch it runs with).

The op is ``recsys/optim/_cowclip_C*.so``. It registers ``torch.ops.recsys.*`` when
``recsys.optim.cowclip_kernel`` loads it with ``torch.ops.load_library`` (it is not a Python
module). Next to it goes ``_cowclip_C.sha256``, the hash of the C++ source it was built from: the
loader uses the compiled op only while that matches the shipped source (an editable install whose
source changed falls back to the JIT build instead of running stale code).

Compile flags are those of the JIT build (``cowclip_kernel.CXX_FLAGS``), plus ``-fno-wrapv``
(CPython's own CFLAGS, which setuptools puts first, carry ``-fwrapv``, which would forbid some loop
optimisations the JIT build gets) and ``-g0`` (no debug info in the installed library).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

SOURCE = "recsys/optim/csrc/cowclip_adam.cpp"
EXT_NAME = "recsys.optim._cowclip_C"
HASH_FILE = "_cowclip_C.sha256"
# Keep in sync with recsys/optim/cowclip_kernel.py (CXX_FLAGS, LD_FLAGS); tests/test_wheel.py checks.
CXX_FLAGS = ["-O3", "-fopenmp", "-DNDEBUG", "-fno-math-errno"]
LD_FLAGS = ["-fopenmp"]


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


setup(
    ext_modules=[
        CppExtension(
            EXT_NAME,
            [SOURCE],
            extra_compile_args={"cxx": CXX_FLAGS + ["-fno-wrapv", "-g0"]},
            extra_link_args=LD_FLAGS,
        )
    ],
    cmdclass={"build_ext": BuildWithSourceHash},
)
