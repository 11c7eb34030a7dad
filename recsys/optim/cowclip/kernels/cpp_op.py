"""Fused CowClip-Adam embedding backward + update: the C++ CPU op ``torch.ops.recsys.cowclip_adam_step_``
(``recsys/optim/csrc/cowclip_adam.cpp``), built when the package is installed (else just in time),
with the torch-ops reference (``recsys.optim.cowclip.reference.cowclip_adam_step``) as the last resort.

``fused_cowclip_adam_step`` updates ONE table in place, given the FBGEMM-style lookup of the batch
(``indices`` [L], ``offsets`` [B+1]) and ``grad_output`` [B, D], the gradient of the pooled (summed)
embeddings. It is the update of ``cowclip_adam_step(..., update_scope="batch", l2_scope="batch",
bias_correction="row")``: lazy Adam on the batch's unique rows, per-row bias correction, rows absent
from the batch bit-identical.

``fused_cowclip_adam_tables`` (op ``torch.ops.recsys.cowclip_adam_tables_``) does the same for all
tables of a table-batched group in one call, shaped like FBGEMM's CPU TBE backward: flat
weights/momentum1/momentum2/row_step buffers, one ``feature_meta`` row per feature, the KJT's
``indices``/``offsets`` [F*B+1] and ``grad_output`` [B, total_D]. It is what
``CowClipAdamTBE.backward_update`` (inline mode) calls: no per-table Python or dispatch overhead,
tables processed in parallel.

Where the op comes from, in this order (``load_extension``):

1. the library built when the package was installed (``setup.py``: ``recsys/optim/_cowclip_C*.so``,
   loaded with ``torch.ops.load_library``), used only while the ``_cowclip_C.sha256`` beside it
   matches the shipped source (an editable install whose C++ changed since ``make venv`` rebuilds
   instead of running stale code);
2. a just-in-time build (``torch.utils.cpp_extension.load``, same flags as the installed build:
   ``CXX_FLAGS``) into a per-user cache, ``$XDG_CACHE_HOME/recsys/torch_extensions/`` (default
   ``~/.cache/recsys/...``; override with ``RECSYS_EXT_DIR``), one directory per Python/torch
   version and source hash, never into site-packages or the repository. The process that builds
   prints one line, ``building the CowClip op (first use, ~10 s) into <dir>``; other processes
   (ranks) wait on a file lock and reuse it. Needs gcc and ``ninja``;
3. the torch-ops reference, with a warning.

``RECSYS_NO_CPP=1`` skips 1 and 2 (reference only); ``RECSYS_CPP_JIT=1`` skips 1 (tests the JIT
build). On CUDA tensors the reference runs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import time
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from recsys.optim.cowclip.catchup import DEFAULT_GROWTH
from recsys.optim.cowclip.reference import CowClipAdamState, CowClipStats, cowclip_adam_step

__all__ = [
    "advise_huge_pages",
    "fused_cowclip_adam_step",
    "fused_cowclip_adam_tables",
    "FEATURE_META_COLUMNS",
    "fused_available",
    "fallback_reason",
    "load_extension",
    "build_dir",
    "cache_root",
    "installed_library",
    "source_sha256",
    "CXX_FLAGS",
    "LD_FLAGS",
]

log = logging.getLogger(__name__)

_NAME = "recsys_cowclip_adam"
_PKG = "recsys.optim"
_SOURCE = "csrc/cowclip_adam.cpp"  # package data of recsys.optim
_INSTALLED = "recsys.optim._cowclip_C"  # built by setup.py
_INSTALLED_HASH = "_cowclip_C.sha256"
# The flags of both builds (setup.py keeps a copy; tests/integration/packaging/test_wheel.py checks they agree). The op uses
# LibTorch's stable ABI only, targeting torch 2.11: one build loads on every torch from 2.11 on.
CXX_FLAGS = ["-O3", "-DNDEBUG", "-fno-math-errno", "-DTORCH_TARGET_VERSION=0x020b000000000000"]
LD_FLAGS: list[str] = []

_loaded: bool | None = None  # None: not tried yet
_reason: str = "not loaded yet"
_build_seconds: float | None = None
_warned = False


def _source_bytes() -> bytes:
    return resources.files(_PKG).joinpath(_SOURCE).read_bytes()


def source_sha256() -> str:
    """SHA-256 of the shipped C++ source: keys the JIT cache and checks the installed library."""
    return hashlib.sha256(_source_bytes()).hexdigest()


def cache_root() -> Path:
    """The per-user root of JIT builds: ``$RECSYS_EXT_DIR``, else ``$XDG_CACHE_HOME/recsys/torch_extensions``,
    else ``~/.cache/recsys/torch_extensions``."""
    root = os.environ.get("RECSYS_EXT_DIR")
    if root:
        return Path(root)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "recsys" / "torch_extensions"


def build_dir() -> Path:
    """Where the JIT fallback builds and caches the op: one directory per Python and torch version
    (ABI) and per source hash, so a changed source never reuses an old build."""
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.replace('+', '_')}_src{source_sha256()[:16]}"
    return cache_root() / tag / _NAME


def installed_library() -> tuple[Path | None, str]:
    """The op built at install time, if it is there and was built from the shipped source:
    (path, "") or (None, why not)."""
    try:
        spec = importlib.util.find_spec(_INSTALLED)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return None, "no installed build"
    lib = Path(spec.origin)
    stamp = lib.with_name(_INSTALLED_HASH)
    try:
        built_from = stamp.read_text().strip()
    except OSError:
        return None, f"{stamp.name} missing next to {lib.name}"
    if built_from != source_sha256():
        return None, f"{lib.name} was built from another version of {_SOURCE} (reinstall: make venv)"
    return lib, ""


def _op_registered() -> bool:
    try:
        torch.ops.recsys.cowclip_adam_step_  # noqa: B018
        torch.ops.recsys.cowclip_adam_tables_  # noqa: B018
        torch.ops.recsys.cowclip_catch_up_tables_  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


def _ninja_path_env() -> dict[str, str]:
    """PATH with the venv's ninja first (cpp_extension runs plain ``ninja``)."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # type: ignore[import-not-found]

        dirs.insert(0, ninja.BIN_DIR)
    except Exception:  # noqa: BLE001 - the system ninja may still do
        pass
    return {"PATH": os.pathsep.join(dirs + [os.environ.get("PATH", "")])}


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def load_extension(require: bool = False, verbose: bool = False) -> bool:
    """Load the op once per process: the installed build, else a JIT build (see the module
    docstring). Returns whether it is available.

    With ``require=True`` a failure raises instead of falling back (tests).
    """
    global _loaded, _reason
    if _loaded is None:
        if _flag("RECSYS_NO_CPP"):
            _loaded, _reason = False, "RECSYS_NO_CPP is set"
        elif _op_registered():  # registered by someone else in this process
            _loaded, _reason = True, "already registered"
        else:
            lib, why_not = (None, "RECSYS_CPP_JIT is set") if _flag("RECSYS_CPP_JIT") else installed_library()
            if lib is not None:
                try:
                    torch.ops.load_library(str(lib))
                except Exception as e:  # noqa: BLE001 - e.g. built against another torch: try the JIT build
                    why_not = f"cannot load {lib.name}: {(str(e).strip().splitlines() or [''])[-1]}"
                else:
                    if _op_registered():
                        _loaded, _reason = True, f"installed build {lib}"
                    else:
                        why_not = f"{lib.name} loaded but the recsys ops are not registered"
        if _loaded is None:
            log.info("CowClip C++ op: %s; using the JIT build", why_not)
            try:
                d = _build_and_load(verbose)
                _loaded, _reason = True, f"JIT build in {d}"
            except Exception as e:  # noqa: BLE001 - any build/load failure means: fall back
                msg = str(e).strip().splitlines()
                _loaded, _reason = False, f"{type(e).__name__}: {msg[-1] if msg else ''}"[:500]
    if require and not _loaded:
        raise RuntimeError(f"CowClip C++ extension not available: {_reason}")
    return bool(_loaded)


def _build_and_load(verbose: bool) -> Path:
    """JIT-build (or reuse) the op in ``build_dir()`` and load it. The source is copied into that
    directory first, so the build never depends on (or writes next to) the installed package."""
    global _build_seconds
    from filelock import FileLock
    from torch.utils import cpp_extension

    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    old_path = os.environ.get("PATH", "")
    with FileLock(str(d.parent / f"{_NAME}.build.lock"), timeout=600):
        # We hold the only build lock: a `lock` baton of cpp_extension left by a killed build is stale
        # (it would make this process wait forever).
        stale = d / "lock"
        if stale.exists():
            stale.unlink()
        src = d / Path(_SOURCE).name
        code = _source_bytes()
        if not src.exists() or src.read_bytes() != code:
            src.write_bytes(code)
        if not (d / f"{_NAME}.so").exists():
            print(f"building the CowClip op (first use, ~10 s) into {d}", file=sys.stderr, flush=True)
        os.environ.update(_ninja_path_env())
        try:
            cpp_extension.load(
                name=_NAME,
                sources=[str(src)],
                # copies: cpp_extension appends its own flags (-ltorch_python ...) to these lists
                extra_cflags=list(CXX_FLAGS),
                extra_ldflags=list(LD_FLAGS),
                build_directory=str(d),
                is_python_module=False,
                verbose=verbose,
            )
        finally:
            os.environ["PATH"] = old_path
    _build_seconds = time.perf_counter() - t0
    if not _op_registered():
        raise RuntimeError("library loaded but torch.ops.recsys.cowclip_adam_step_/cowclip_adam_tables_ are not registered")
    return d


def advise_huge_pages(tensors) -> int:
    """Back the tensors' memory with 2 MB transparent huge pages, in place (same addresses, so every
    view stays valid): ``madvise(MADV_HUGEPAGE)`` then ``madvise(MADV_COLLAPSE)`` (Linux >= 6.1) on
    the 2 MB-aligned part of each. Returns the bytes collapsed (0 where the kernel or THP setting
    refuses; never raises). ``CowClipAdamTBE`` calls it on CPU state of ``HUGE_PAGE_MIN_BYTES`` or
    more. At 1M rows x 26 tables lazy Adam's 4 random rows per id (w, m, v, row_step) cost 4 page
    walks with 4 KB pages; see benchmarks/2026-11-22-cowclip-kernel.md."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    MADV_HUGEPAGE, MADV_COLLAPSE, HP = 14, 25, 2 << 20
    done = 0
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            continue
        p = t.data_ptr()
        a = (p + HP - 1) & ~(HP - 1)
        n = (p + t.numel() * t.element_size() - a) & ~(HP - 1)
        if n > 0 and madvise(a, n, MADV_HUGEPAGE) == 0 and madvise(a, n, MADV_COLLAPSE) == 0:
            done += n
    return done


def fused_available() -> bool:
    """True when CPU calls of ``fused_cowclip_adam_step`` run the C++ op (builds it on first call)."""
    return load_extension()


def fallback_reason() -> str:
    """Why the C++ op is (not) used, for logs."""
    load_extension()
    return _reason


def build_seconds() -> float | None:
    """Seconds spent in the JIT build/load in this process (None when no JIT build ran here)."""
    return _build_seconds


def _warn_once(why: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("CowClip-Adam: using the torch-ops reference instead of the fused C++ op (%s)", why)


FEATURE_META_COLUMNS = ("weights_offset", "rows", "dim", "grad_col", "row_start", "clip")


def fused_cowclip_adam_tables(
    weights: Tensor,
    momentum1: Tensor,
    momentum2: Tensor,
    row_step: Tensor,
    feature_meta: Tensor,
    zeta: Tensor,
    indices: Tensor,
    offsets: Tensor,
    grad_output: Tensor,
    per_sample_weights: Tensor | None = None,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    r: float = 1.0,
    l2: float = 0.0,
    eps_mode: str = "torch",
) -> Tensor:
    """One lazy CowClip-Adam step of every table of a table-batched group, in place.

    ``weights``/``momentum1``/``momentum2``: flat float32 buffers; ``row_step``: flat int64 [total rows].
    ``feature_meta``: int64 [F, 6], per feature f (which reads exactly one table; no two features
    the same table): ``FEATURE_META_COLUMNS`` = offset of the table in the flat buffers, its rows,
    its dim D, its first column in ``grad_output``, its first entry in ``row_step``, clip (0/1).
    ``zeta``: float64 [F], the per-table zeta (the op uses zeta' = r * sqrt(D) * zeta).
    ``indices`` [L] and ``offsets`` [F*B+1] (same integer dtype, int32 or int64): the KJT lookup,
    feature-major; ``grad_output`` [B, total_D] float32 with unit column stride.

    Per table, the same result as ``fused_cowclip_adam_step`` on that table's views (and so as the
    reference); the tables' 0-dim ``step`` counters are not touched. Returns int64 [F, 2]:
    (unique rows, clipped rows) per feature. Requires the C++ extension (``fused_available()``)
    and CPU tensors: callers fall back to a per-table loop otherwise.
    """
    if eps_mode not in ("torch", "keras"):
        raise ValueError(f"eps_mode must be torch|keras, got {eps_mode!r}")
    load_extension(require=True)
    if grad_output.dtype != torch.float32 or grad_output.stride(-1) != 1:
        grad_output = grad_output.to(torch.float32).contiguous()
    if offsets.dtype != indices.dtype:
        offsets = offsets.to(indices.dtype)
    if indices.dtype not in (torch.int32, torch.int64):
        indices, offsets = indices.long(), offsets.long()
    psw = per_sample_weights
    if psw is not None and (psw.dtype != torch.float32 or not psw.is_contiguous()):
        psw = psw.to(torch.float32).contiguous()
    return torch.ops.recsys.cowclip_adam_tables_(
        weights,
        momentum1,
        momentum2,
        row_step,
        feature_meta,
        zeta,
        indices.contiguous(),
        offsets.contiguous(),
        grad_output,
        psw,
        float(lr),
        float(betas[0]),
        float(betas[1]),
        float(eps),
        float(r),
        float(l2),
        eps_mode == "keras",
    )


def fused_catch_up_tables(
    weights: Tensor,
    momentum1: Tensor,
    momentum2: Tensor,
    row_step: Tensor,
    feature_meta: Tensor,
    indices: Tensor,
    offsets: Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    l2: float = 0.0,
    eps_mode: str = "torch",
    growth: float = DEFAULT_GROWTH,
) -> Tensor:
    """The catch-up of ``recsys.optim.cowclip.catchup.catch_up`` for every row a lookup reads, in
    place, in one C++ call: rows whose ``row_step`` is behind ``step`` get the block scheme's
    dense L2-only steps up to ``step`` and ``row_step = step``. Buffers and ``feature_meta`` as in
    ``fused_cowclip_adam_tables`` (its clip and grad-column fields are not used). Rows are found,
    read and written once (no unique/sort/gather passes); each distinct gap's schedule is computed
    once per call. Returns int64 [F]: rows advanced per feature. CPU tensors and the extension only."""
    if eps_mode not in ("torch", "keras"):
        raise ValueError(f"eps_mode must be torch|keras, got {eps_mode!r}")
    load_extension(require=True)
    if offsets.dtype != indices.dtype:
        offsets = offsets.to(indices.dtype)
    if indices.dtype not in (torch.int32, torch.int64):
        indices, offsets = indices.long(), offsets.long()
    return torch.ops.recsys.cowclip_catch_up_tables_(
        weights,
        momentum1,
        momentum2,
        row_step,
        feature_meta,
        indices.contiguous(),
        offsets.contiguous(),
        int(step),
        float(lr),
        float(betas[0]),
        float(betas[1]),
        float(eps),
        float(l2),
        eps_mode == "keras",
        float(growth),
    )


def fused_cowclip_adam_step(
    weight: Tensor,
    state: CowClipAdamState,
    indices: Tensor,
    offsets: Tensor,
    grad_output: Tensor,
    per_sample_weights: Tensor | None = None,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    r: float = 1.0,
    zeta: float = 1e-5,
    l2: float = 0.0,
    clip: bool = True,
    eps_mode: str = "torch",
) -> CowClipStats:
    """One lazy CowClip-Adam step of one table, in place on ``weight`` [N, D] and ``state``.

    Same result as ``cowclip_adam_step(weight, state, indices, offsets, grad_output,
    per_sample_weights, lr=..., betas=..., eps=..., r=..., zeta=..., l2=..., clip=...,
    update_scope="batch", l2_scope="batch", bias_correction="row", eps_mode=...)``.
    """
    if eps_mode not in ("torch", "keras"):
        raise ValueError(f"eps_mode must be torch|keras, got {eps_mode!r}")
    on_cpu = weight.device.type == "cpu"
    ok = (
        on_cpu
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.is_contiguous()
        and state.exp_avg.is_contiguous()
        and state.exp_avg_sq.is_contiguous()
        and state.row_step.is_contiguous()
    )
    if ok and load_extension():
        with torch.no_grad():
            go = grad_output.detach()
            if go.dtype != torch.float32 or not go.is_contiguous():
                go = go.to(torch.float32).contiguous()
            psw = per_sample_weights
            if psw is not None:
                psw = psw.detach().to(torch.float32).contiguous()
            out = torch.ops.recsys.cowclip_adam_step_(
                weight,
                state.exp_avg,
                state.exp_avg_sq,
                state.row_step,
                indices.long().contiguous(),
                offsets.long().contiguous(),
                go,
                psw,
                float(lr),
                float(betas[0]),
                float(betas[1]),
                float(eps),
                float(r),
                float(zeta),
                float(l2),
                bool(clip),
                eps_mode == "keras",
            )
            state.step.add_(1)
        n_unique, n_clipped = int(out[0]), out[1]
        return CowClipStats(
            unique_rows=n_unique,
            clipped_rows=n_clipped,
            clipped_fraction=n_clipped.to(torch.float32) / max(n_unique, 1),
        )
    if not on_cpu:
        why = f"{weight.device.type} tensors"
    elif not ok:
        why = "weight not contiguous float32 [N, D]"
    else:
        why = _reason
    _warn_once(why)
    return cowclip_adam_step(
        weight,
        state,
        indices,
        offsets,
        grad_output,
        per_sample_weights,
        lr=lr,
        betas=betas,
        eps=eps,
        r=r,
        zeta=zeta,
        l2=l2,
        clip=clip,
        update_scope="batch",
        l2_scope="batch",
        bias_correction="row",
        eps_mode=eps_mode,
    )
