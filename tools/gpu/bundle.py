"""Pack TorchRec + CUDA FBGEMM for a GPU machine that has torch but no network and takes at most
64 MiB per command: a few carry folders (``.gpu/p0``, ``.gpu/p1``, ...) that ``tools/gpu/check.sh``
reassembles there.

What goes in: the registry's ``fbgemm-gpu==1.6.0`` (the CUDA 13 build for torch 2.11: 465 MB
wheel, 2.5 GB unpacked), ``torchrec==1.6.1`` and the pure-Python requirements a stock torch image
lacks (``tensordict``, ``pyvers``, ``iopath``, ``torchmetrics==1.0.3``, the version torchrec 1.6.1
pins). Everything is unpacked as pip would install it, then packed into one ``tar.xz`` cut into
parts of at most ``--part-mib`` MiB, with a manifest of SHA-256 sums (each part, the whole
archive, every wheel).

What is left out, and why that is safe: nothing is dropped from the file list (every library
that ``fbgemm_gpu/__init__.py`` loads at import is there, so the package imports unchanged).
Inside FBGEMM's shared libraries, the CUDA fat binaries hold one compiled kernel image (cubin)
per GPU architecture: sm_80, sm_90 and sm_100 in this build, and no PTX. A GPU runs only the
cubin of its own major architecture (an H100 or H200 is sm_90; sm_80 and sm_100 code cannot run
there and the driver never reads it), so ``--keep-arch 90`` overwrites the other cubins' bytes
with zeros, leaving every header, offset and size as it was: the files keep their length and
layout, and the zeros compress to nothing. That takes the archive from ~465 MB to ~85 MB, two
carried folders. On a GPU of another architecture keep its cubins instead (``--keep-arch 80``),
or none (``--keep-arch all``).

    python tools/gpu/bundle.py                       # download (pip, into ~/.cache/recsys/gpu-wheels), pack into .gpu/
    python tools/gpu/bundle.py --verify              # reassemble .gpu/ into a scratch dir and check every hash
    python tools/gpu/bundle.py --verify --target DIR # ... into DIR, kept (what tools/gpu/check.sh does)
    python tools/gpu/bundle.py --verify --import-with PY   # ... and import fbgemm_gpu and torchrec with that Python

The last line of stdout is one JSON object (sizes, hashes, what was zeroed).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# name==version: the stack of constraints-oldest.txt, for the machine's torch 2.11 / Python 3.12
PACKAGES = ["fbgemm-gpu==1.6.0", "torchrec==1.6.1", "tensordict==0.15.3", "pyvers==0.2.3", "iopath==0.1.10", "torchmetrics==1.0.3"]
PYTHON = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
FATBIN_MAGIC = 0xBA55ED50


def wheel_cache() -> Path:
    return Path(os.environ.get("RECSYS_GPU_WHEELS", Path.home() / ".cache" / "recsys" / "gpu-wheels"))


def _wheel_for(cache: Path, spec: str) -> Path | None:
    name, version = spec.split("==")
    stem = name.replace("-", "_") + "-" + version + "-"
    found = sorted(p for p in cache.glob("*.whl") if p.name.lower().startswith(stem.lower()))
    return found[0] if found else None


def download(cache: Path) -> list[Path]:
    """Each package's wheel from the registry (``pip download``; iopath 0.1.10 is an sdist there,
    so it is built into a wheel), kept in ``cache`` across runs."""
    cache.mkdir(parents=True, exist_ok=True)
    wheels = []
    for spec in PACKAGES:
        whl = _wheel_for(cache, spec)
        if whl is None:
            plat = [a for p in PLATFORMS for a in ("--platform", p)]
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "--only-binary=:all:",
                    "--python-version",
                    PYTHON,
                    "--implementation",
                    "cp",
                    *plat,
                    "-d",
                    str(cache),
                    spec,
                ],
                capture_output=True,
                text=True,
            )
            if r.returncode != 0:  # no wheel on the registry: build one from the sdist (pure Python)
                r = subprocess.run(
                    [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(cache), spec], capture_output=True, text=True
                )
            whl = _wheel_for(cache, spec)
            if whl is None:
                raise SystemExit(f"gpu_bundle: could not get a wheel of {spec}: {r.stderr.strip()[-500:]}")
        wheels.append(whl)
    return wheels


def _fatbin_section(data: bytes) -> tuple[int, int] | None:
    """(file offset, size) of the ELF section ``.nv_fatbin``; None where there is none."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return None
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def sh(i):  # name, offset, size
        base = shoff + i * shentsize
        (name,) = struct.unpack_from("<I", data, base)
        off, size = struct.unpack_from("<QQ", data, base + 0x18)
        return name, off, size

    _, stroff, _ = sh(shstrndx)
    for i in range(shnum):
        name, off, size = sh(i)
        end = data.index(b"\0", stroff + name)
        if data[stroff + name : end] == b".nv_fatbin":
            return off, size
    return None


def prune_fatbins(data: bytearray, keep: int) -> dict[str, int]:
    """Zero the payload of every cubin/PTX entry of ``.nv_fatbin`` whose architecture is not
    ``keep``; headers, sizes and offsets stay. Returns bytes kept and zeroed per architecture."""
    sec = _fatbin_section(data)
    out: dict[str, int] = {}
    if sec is None:
        return out
    start, size = sec
    pos, end_sec = start, start + size
    while pos + 16 <= end_sec:
        magic, _ver, hsize, fsize = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # blobs are 8-byte aligned; padding between them
            continue
        e, end = pos + hsize, pos + hsize + fsize
        while e < end:
            _kind, _v, ehsize, psize = struct.unpack_from("<HHIQ", data, e)
            (arch,) = struct.unpack_from("<I", data, e + 28)
            key = f"sm_{arch}"
            if arch == keep:
                out[key + "_kept"] = out.get(key + "_kept", 0) + psize
            else:
                data[e + ehsize : e + ehsize + psize] = bytes(psize)
                out[key + "_zeroed"] = out.get(key + "_zeroed", 0) + psize
            e += ehsize + psize
        pos = end
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def pack(wheels: list[Path], out: Path, part_mib: int, keep: int | None, level: int) -> dict:
    """Unpack the wheels (as ``pip install --target`` lays them out), prune, tar | xz, split."""
    report: dict = {"wheels": {w.name: sha256(w) for w in wheels}, "keep_arch": keep, "fatbin": {}}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    archive = out / "bundle.tar.xz"
    xz = subprocess.Popen(["xz", "-T0", f"-{level}", "-c"], stdin=subprocess.PIPE, stdout=open(archive, "wb"))
    unpacked = 0
    with tarfile.open(fileobj=xz.stdin, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for whl in wheels:
            with zipfile.ZipFile(whl) as z:
                for info in sorted(z.infolist(), key=lambda i: i.filename):
                    if info.is_dir():
                        continue
                    data = z.read(info)
                    unpacked += len(data)
                    if keep is not None and info.filename.endswith(".so"):
                        data = bytearray(data)
                        stats = prune_fatbins(data, keep)
                        if stats:
                            report["fatbin"][info.filename] = stats
                        data = bytes(data)
                    ti = tarfile.TarInfo(info.filename)
                    ti.size, ti.mtime = len(data), 0
                    ti.mode = 0o755 if info.filename.endswith(".so") else 0o644
                    tar.addfile(ti, io.BytesIO(data))
    xz.stdin.close()
    if xz.wait() != 0:
        raise SystemExit("gpu_bundle: xz failed")
    total = archive.stat().st_size
    part = part_mib * 2**20
    parts = []
    with open(archive, "rb") as f:
        i = 0
        while chunk := f.read(part):
            d = out / f"p{i}"
            d.mkdir()
            (d / f"part{i}").write_bytes(chunk)
            parts.append({"path": f"p{i}/part{i}", "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
            i += 1
    report.update(archive_bytes=total, archive_sha256=sha256(archive), unpacked_bytes=unpacked, parts=parts)
    zeroed = sum(v for s in report["fatbin"].values() for k, v in s.items() if k.endswith("_zeroed"))
    kept = sum(v for s in report["fatbin"].values() for k, v in s.items() if k.endswith("_kept"))
    report["fatbin_bytes"] = {"kept": kept, "zeroed": zeroed}
    archive.unlink()
    # the manifest travels with the last part (the command that reassembles reads it there)
    (out / f"p{len(parts) - 1}" / "manifest.json").write_text(json.dumps(report, indent=1))
    return report


def reassemble(src: Path, target: Path) -> dict:
    """What gpu_check.sh does on the GPU machine: check each part's hash, join, check the
    archive's hash, unpack into ``target`` (with tar and xz where the machine has them, else
    with Python's tarfile/lzma)."""
    manifest = json.loads(next(src.glob("p*/manifest.json")).read_text())
    missing = [p["path"] for p in manifest["parts"] if not (src / p["path"]).is_file()]
    if missing:
        raise SystemExit(f"gpu_bundle: {src}: missing {', '.join(missing)} (each carried folder must arrive while the machine is warm)")
    h = hashlib.sha256()
    for p in manifest["parts"]:
        data = (src / p["path"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != p["sha256"]:
            raise SystemExit(f"gpu_bundle: {src / p['path']}: sha256 mismatch")
        h.update(data)
    if h.hexdigest() != manifest["archive_sha256"]:
        raise SystemExit("gpu_bundle: archive sha256 mismatch")
    target.mkdir(parents=True, exist_ok=True)
    if shutil.which("tar") and shutil.which("xz"):
        tar = subprocess.Popen(["tar", "-xJf", "-", "-C", str(target)], stdin=subprocess.PIPE)
        for p in manifest["parts"]:
            tar.stdin.write((src / p["path"]).read_bytes())
        tar.stdin.close()
        if tar.wait() != 0:
            raise SystemExit("gpu_bundle: unpacking failed")
    else:

        class Parts(io.RawIOBase):
            def __init__(self):
                self.files = [open(src / p["path"], "rb") for p in manifest["parts"]]

            def readable(self):
                return True

            def readinto(self, b):
                while self.files:
                    n = self.files[0].readinto(b)
                    if n:
                        return n
                    self.files.pop(0).close()
                return 0

        with tarfile.open(fileobj=io.BufferedReader(Parts(), 1 << 20), mode="r|xz") as t:
            t.extractall(target, filter="data")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / ".gpu"), help="where the carry folders p0, p1, ... go")
    ap.add_argument("--part-mib", type=int, default=48, help="MiB per part (a command carries 64 MiB with the working tree, ~3 MiB)")
    ap.add_argument("--keep-arch", default="90", help="the GPU architecture whose cubins stay (90: H100/H200), or all")
    ap.add_argument("--level", type=int, default=6, help="xz preset")
    ap.add_argument("--verify", action="store_true", help="reassemble --out into a scratch dir and check it")
    ap.add_argument("--target", default="", help="with --verify: unpack here (kept) instead of a scratch dir")
    ap.add_argument(
        "--import-with",
        default="",
        help="with --verify: a Python 3.12 with torch 2.11 that imports fbgemm_gpu and torchrec from the scratch dir",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    t0 = time.perf_counter()
    if args.verify:
        with tempfile.TemporaryDirectory() as scratch:
            tmp = args.target or scratch
            manifest = reassemble(out, Path(tmp))
            res = {
                "verified": True,
                "parts": len(manifest["parts"]),
                "archive_sha256": manifest["archive_sha256"],
                "unpack_s": round(time.perf_counter() - t0, 1),
            }
            if args.import_with:
                code = (
                    "import fbgemm_gpu, torchrec, torch; from fbgemm_gpu.split_table_batched_embeddings_ops_training "
                    "import SplitTableBatchedEmbeddingBagsCodegen; print(fbgemm_gpu.__version__, torchrec.__version__, "
                    "hasattr(torch.ops.fbgemm, 'split_embedding_codegen_lookup_adam_function_pt2'))"
                )
                r = subprocess.run([args.import_with, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tmp})
                res["import"] = r.stdout.strip() if r.returncode == 0 else f"failed: {r.stderr.strip()[-800:]}"
            print(json.dumps(res))
            return 0 if "failed" not in str(res.get("import", "")) else 1
    keep = None if args.keep_arch == "all" else int(args.keep_arch)
    report = pack(download(wheel_cache()), out, args.part_mib, keep, args.level)
    for p in report["parts"]:
        print(f"{out / p['path']}: {p['bytes'] / 2**20:.1f} MiB")
    summary = {k: report[k] for k in ("archive_bytes", "unpacked_bytes", "fatbin_bytes", "keep_arch", "archive_sha256")}
    summary.update(parts=len(report["parts"]), pack_s=round(time.perf_counter() - t0, 1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
