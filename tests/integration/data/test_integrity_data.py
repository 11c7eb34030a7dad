"""Run integrity, data and config side: never train on stale data, and every broken
input stops `recsys train` before any worker starts with one line naming the file, exit 2, and
nothing half-written (a cache directory is complete or absent, no temp directory stays).

Data is real: the 1000 Criteo Kaggle rows in ../shared/data (RECSYS_SHARED_DIR overrides), cut,
corrupted, compressed and truncated here. Expected messages are spelled out in full.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from recsys.config import load_config  # noqa: E402
from recsys.data.preprocess import raw_formats as rf  # noqa: E402
from recsys.data.batching import steps_per_epoch  # noqa: E402
from recsys.data.cache_key import describe_change, make_key  # noqa: E402
from recsys.data.errors import CacheWriteError, DataFileError  # noqa: E402
from recsys.data.shard_format import MANIFEST_NAME  # noqa: E402
from recsys.data.shard_reader import ShardedDataset  # noqa: E402
from recsys.data.source import TRAIN, ShardSource, prepare_data, shard_dir  # noqa: E402
from tests.support.processes import run_main_and_children  # noqa: E402

SMOKE = REPO / "configs" / "experiments" / "smoke.yaml"
SHARED = Path(os.environ.get("RECSYS_SHARED_DIR") or REPO.parent / "shared") / "data"


@pytest.fixture(scope="module")
def kaggle_lines() -> list[str]:
    p = SHARED / "criteo_kaggle_sample_1k.tsv"
    if not p.is_file():
        pytest.skip(f"shared sample data not available: {p}")
    lines = p.read_text().splitlines(keepends=True)
    assert len(lines) == 1000
    return lines


def write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))
    return path


def overrides(tmp_path: Path, data_path: Path | str, *extra: str) -> list[str]:
    """smoke.yaml on raw Criteo rows: one process, small batches, a few steps."""
    return [
        "data.source=criteo",
        f"data.path={data_path}",
        f"run_dir={tmp_path / 'run'}",
        "train.nproc_per_node=1",
        "train.batch_size=64",
        "train.eval_batch_size=64",
        "train.max_steps=3",
        *extra,
    ]


def recsys_train(
    tmp_path: Path, args: list[str], config: Path = SMOKE, as_nobody: bool = False, timeout: int = 300
) -> subprocess.CompletedProcess:
    """`recsys train` with the launcher in this process (its torchrun and workers are real
    processes), or, ``as_nobody``, the whole command as another user."""
    if not as_nobody:
        return run_main_and_children("recsys.cli", "train", "--config", str(config), *args, cwd=tmp_path, timeout=timeout)
    cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "recsys.cli", "train"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([*cmd, "--config", str(config), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(r: subprocess.CompletedProcess, message: str, before: list[str] = ()) -> None:
    """Exit 2 before launch; stderr is exactly `before` lines then `error: message`; no traceback."""
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == [*before, f"error: {message}"], r.stderr
    assert r.returncode == 2


def assert_nothing_half_written(parent: Path, complete: list[str] = ()) -> None:
    """Under `parent` only the named cache directories, each complete; no temp dirs."""
    names = sorted(p.name for p in parent.iterdir()) if parent.exists() else []
    assert names == sorted(complete), names
    for name in complete:
        ShardedDataset.open(parent / name)


# ---------------------------------------------------------------------------------------------
# 1. the cache is keyed by content
# ---------------------------------------------------------------------------------------------


def test_replaced_file_is_rebuilt_and_trained_on(tmp_path, kaggle_lines):
    """1000 rows -> 300 rows under the same name: rebuilt (one line says why) and trained on 300,
    exactly like a run on a fresh cache of the 300-row file."""
    day = write(tmp_path / "data" / "day.tsv", kaggle_lines)
    cache = tmp_path / "cache"
    r = recsys_train(tmp_path, overrides(tmp_path, day, f"data.cache_dir={cache}"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert ShardedDataset.open(cache).num_rows == 1000
    assert "(14 steps/epoch)" in r.stderr  # 900 training rows / 64

    old_size = day.stat().st_size
    write(day, kaggle_lines[:300])
    r = recsys_train(tmp_path, overrides(tmp_path, day, f"data.cache_dir={cache}", f"run_dir={tmp_path / 'run2'}"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.splitlines()[0] == (
        f"{cache}: rebuilding the shard cache: {day} changed (size {old_size} -> {day.stat().st_size} bytes)"
    )
    assert "(4 steps/epoch)" in r.stderr  # 270 training rows / 64
    # the first run's checkpoint knows it trained on the 1000-row file: no resume on these 300 rows
    r = recsys_train(tmp_path, overrides(tmp_path, day, f"data.cache_dir={cache}", "resume=true", "train.max_steps=6"))
    assert_one_line_error(
        r,
        (
            f"cannot resume from {tmp_path / 'run'}/checkpoints/step_000000003: it trained on other data (day.tsv: 1000 "
            f"rows, {old_size} bytes -> 300 rows, {day.stat().st_size} bytes); restore that data, or pass "
            "resume_on_new_data=true to go on training on this data (its epochs counted from step 3)"
        ),
    )
    rebuilt = json.loads((tmp_path / "run2" / "summary.json").read_text())
    assert rebuilt["eval_rows"] == 30
    assert ShardedDataset.open(cache).num_rows == 300

    # the same run on a brand-new cache of the 300-row file: the same model, metric for metric
    r = recsys_train(tmp_path, overrides(tmp_path, day, f"data.cache_dir={tmp_path / 'fresh'}", f"run_dir={tmp_path / 'run3'}"))
    assert r.returncode == 0, r.stderr[-3000:]
    fresh = json.loads((tmp_path / "run3" / "summary.json").read_text())
    assert (fresh["auc"], fresh["logloss"], fresh["eval_rows"]) == (rebuilt["auc"], rebuilt["logloss"], 30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "data", "fresh", "run", "run2", "run3"]


def test_auc_of_a_one_class_eval_split_is_undefined_not_zero(tmp_path, kaggle_lines):
    """The eval split (the last 10% of rows) holds only negatives: AUC has no positive/negative
    pair to rank. The log says so in words, summary.json and metrics.jsonl hold null."""
    lines = [line if line.endswith("\n") else line + "\n" for line in kaggle_lines]
    negatives = [line for line in lines if line.startswith("0\t")]
    day = write(tmp_path / "day.tsv", lines[:900] + negatives[:100])
    r = recsys_train(tmp_path, overrides(tmp_path, day))
    assert r.returncode == 0, r.stderr[-3000:]
    evals = [line for line in r.stderr.splitlines() if "eval step 3:" in line]
    assert len(evals) == 1 and re.search(r"eval step 3: auc undefined \(every eval label is 0\) logloss \d\.\d{4}$", evals[0]), evals
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["auc"] is None and summary["auc_undefined"] == "every eval label is 0"
    assert "auc_gap_to_oracle" not in summary and summary["logloss"] > 0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["auc"] for m in metrics if m["kind"] == "eval"] == [None]


def test_same_basename_elsewhere_with_bad_labels_aborts(tmp_path, kaggle_lines):
    """Another day.tsv (10% bad labels) never reuses the first one's cache: it aborts, and the
    first cache stays complete and still matches its own file."""
    good = write(tmp_path / "a" / "day.tsv", kaggle_lines)
    bad_lines = [("x" + ln[1:]) if i % 10 == 0 else ln for i, ln in enumerate(kaggle_lines)]
    bad = write(tmp_path / "b" / "day.tsv", bad_lines)
    first = load_config(SMOKE, overrides(tmp_path, good))
    monkey_cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert prepare_data(first)["num_rows"] == 1000
        good_cache = shard_dir(first)
    finally:
        os.chdir(monkey_cwd)
    expected = (
        f"{bad}: bad-row fraction 0.1000 (100 of 1000 rows: bad label: 100) exceeds max_bad_fraction=0.01; "
        "first bad lines: 1, 11, 21, 31, 41; nothing was written"
    )
    # default cache location: a directory per input path, so the first cache is not even touched
    r = recsys_train(tmp_path, overrides(tmp_path, bad))
    assert_one_line_error(r, expected)
    assert_nothing_half_written(tmp_path / "data_cache", [good_cache.name])
    # one explicit cache_dir for both: the key differs, the rebuild aborts, the old cache stays
    r = recsys_train(tmp_path, overrides(tmp_path, bad, f"data.cache_dir={(tmp_path / good_cache).resolve()}"))
    assert_one_line_error(
        r,
        expected,
        before=[f"{tmp_path / good_cache}: rebuilding the shard cache: new input file {bad}; input file {good} no longer given"],
    )
    assert_nothing_half_written(tmp_path / "data_cache", [good_cache.name])
    assert ShardedDataset.open(tmp_path / good_cache).manifest["cache_key"]["files"][0]["path"] == str(good)
    assert not (tmp_path / "run").exists()


def test_same_size_and_mtime_with_other_content_rebuilds(tmp_path, kaggle_lines, caplog):
    day = write(tmp_path / "day.tsv", kaggle_lines[:200])
    out = tmp_path / "cache"
    m = rf.preprocess_criteo(day, out)
    st = day.stat()
    swapped = kaggle_lines[1:200] + kaggle_lines[:1]  # same bytes, other order: same size
    write(day, swapped)
    os.utime(day, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert day.stat().st_size == st.st_size and day.stat().st_mtime_ns == st.st_mtime_ns
    caplog.set_level(logging.WARNING, logger="recsys.data.preprocess.raw_formats")
    m2 = rf.preprocess_criteo(day, out)
    assert [r.getMessage() for r in caplog.records] == [f"{out}: rebuilding the shard cache: {day} changed (content changed)"]
    first_label = float(kaggle_lines[1].split("\t")[0])
    assert ShardedDataset.open(out).read(0, 1)[2][0] == first_label
    assert m2["cache_key"] != m["cache_key"] and m2["num_rows"] == 200


def _edit_middle_keep_size_and_mtime(path: Path, block: int = 1 << 20) -> None:
    """Swap two label characters past the first and before the last MiB (both keep the
    head/tail hashes), then restore the mtime: only a whole-file hash can see it."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    assert len(data) > 3 * block
    lo = data.index(b"\n", block + 1) + 1  # the start of a line in the middle
    hi = data.index(b"\n", lo) + 1
    while data[hi : hi + 1] == data[lo : lo + 1]:  # a line whose label differs
        hi = data.index(b"\n", hi) + 1
    data[lo], data[hi] = data[hi], data[lo]
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_an_edit_in_the_middle_with_size_and_mtime_kept_is_found_by_the_full_hash(tmp_path, kaggle_lines, caplog):
    """The head/tail key cannot see it; data.verify=full (the default) rehashes every byte and
    rebuilds; data.verify=quick reuses the cache and says what it trusted."""
    lines = [line if line.endswith("\n") else line + "\n" for line in kaggle_lines]
    big = write(tmp_path / "day.tsv", lines * 15)  # ~3.6 MB: a middle outside the first/last MiB
    out = tmp_path / "cache"
    m = rf.preprocess_criteo(big, out)
    assert m["sources"][0]["sha256"] == hashlib.sha256(big.read_bytes()).hexdigest()
    labels_before = ShardedDataset.open(out).read(0, m["num_rows"])[2].copy()
    _edit_middle_keep_size_and_mtime(big)
    caplog.set_level(logging.INFO, logger="recsys.data.preprocess.raw_formats")
    reused = rf.preprocess_criteo(big, out, verify="quick")
    assert reused["sources"][0]["sha256"] == m["sources"][0]["sha256"]  # stale, as announced:
    assert caplog.records[-1].getMessage() == (
        f"{out}: shard cache is up to date ({m['num_rows']} rows; data.verify=quick: inputs matched by size, "
        "modification time and first and last MiB, not every byte); skipping preprocessing"
    )
    caplog.clear()
    rebuilt = rf.preprocess_criteo(big, out)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"{out}: rebuilding the shard cache: {big} changed (same size and modification time, other content: its SHA-256 differs)"
    ]
    labels_after = ShardedDataset.open(out).read(0, rebuilt["num_rows"])[2]
    assert (labels_after != labels_before).sum() == 2  # the two swapped labels, now as in the file
    caplog.clear()
    rf.preprocess_criteo(big, out)
    assert caplog.records[-1].getMessage().endswith("rows; every byte of the inputs verified); skipping preprocessing")


def test_a_cache_without_content_hashes_is_reused_with_a_warning(tmp_path, kaggle_lines, caplog):
    day = write(tmp_path / "day.tsv", kaggle_lines[:200])
    out = tmp_path / "cache"
    m = rf.preprocess_criteo(day, out)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    for src in manifest["sources"]:
        del src["sha256"]
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    caplog.set_level(logging.WARNING, logger="recsys.data.preprocess.raw_formats")
    assert rf.preprocess_criteo(day, out)["num_rows"] == m["num_rows"]
    assert [r.getMessage() for r in caplog.records] == [
        f"{out}: {day} predates whole-file hashes: reused as matched by size, modification time and first and "
        "last MiB only (delete the cache to rebuild it with them)"
    ]


def test_new_or_removed_file_in_a_directory_input_rebuilds(tmp_path, kaggle_lines, caplog):
    d = tmp_path / "days"
    write(d / "day_0.tsv", kaggle_lines[:500])
    write(d / "day_1.tsv", kaggle_lines[500:800])
    cfg = load_config(SMOKE, overrides(tmp_path, d, f"data.cache_dir={tmp_path / 'cache'}"))
    caplog.set_level(logging.INFO, logger="recsys.data.preprocess.raw_formats")
    assert prepare_data(cfg)["num_rows"] == 800
    caplog.clear()
    assert prepare_data(cfg)["num_rows"] == 800  # unchanged: reused
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'cache'}: shard cache is up to date (800 rows; every byte of the inputs verified); skipping preprocessing"
    ]
    write(d / "day_2.tsv", kaggle_lines[800:])
    caplog.clear()
    assert prepare_data(cfg)["num_rows"] == 1000
    assert caplog.records[0].getMessage() == (f"{tmp_path / 'cache'}: rebuilding the shard cache: new input file {d / 'day_2.tsv'}")
    (d / "day_0.tsv").unlink()
    caplog.clear()
    assert prepare_data(cfg)["num_rows"] == 500
    assert caplog.records[0].getMessage() == (
        f"{tmp_path / 'cache'}: rebuilding the shard cache: input file {d / 'day_0.tsv'} no longer given"
    )
    # a changed option is a change too
    caplog.clear()
    assert (
        prepare_data(load_config(SMOKE, overrides(tmp_path, d, f"data.cache_dir={tmp_path / 'cache'}", "data.max_bad_fraction=0.05")))[
            "num_rows"
        ]
        == 500
    )
    assert caplog.records[0].getMessage() == (
        f"{tmp_path / 'cache'}: rebuilding the shard cache: parse options changed: max_bad_fraction 0.01 -> 0.05"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "days"]


def test_cache_without_a_key_is_not_reused(tmp_path, kaggle_lines, caplog):
    """A cache written before content keys existed (manifest without cache_key) is rebuilt."""
    day = write(tmp_path / "day.tsv", kaggle_lines[:100])
    out = tmp_path / "cache"
    rf.preprocess_criteo(day, out)
    man = json.loads((out / MANIFEST_NAME).read_text())
    del man["cache_key"]
    (out / MANIFEST_NAME).write_text(json.dumps(man))
    caplog.set_level(logging.WARNING, logger="recsys.data.preprocess.raw_formats")
    assert "cache_key" in rf.preprocess_criteo(day, out)
    assert [r.getMessage() for r in caplog.records] == [
        f"{out}: rebuilding the shard cache: it was built without a content key (an older version); its inputs cannot be verified"
    ]


def test_describe_change_names_the_file_and_what(tmp_path):
    a, b = tmp_path / "a.tsv", tmp_path / "b.tsv"
    a.write_text("1\n")
    b.write_text("2\n")
    k = make_key([a, b], {"kind": "criteo"})
    assert describe_change(k, make_key([a, b], {"kind": "criteo"})) is None
    assert describe_change(k, make_key([b, a], {"kind": "criteo"})) == "the input files are given in another order"
    assert describe_change(k, make_key([a, b], {"kind": "avazu"})) == "parse options changed: kind 'criteo' -> 'avazu'"
    a.write_text("10\n")
    assert describe_change(k, make_key([a, b], {"kind": "criteo"})) == f"{a} changed (size 2 -> 3 bytes)"


# ---------------------------------------------------------------------------------------------
# 2. too few rows: stop before workers start
# ---------------------------------------------------------------------------------------------


def test_empty_file_stops_before_launch_and_caches_nothing(tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    r = recsys_train(tmp_path, overrides(tmp_path, empty))
    assert_one_line_error(r, f"{empty}: no valid rows (0 rows read); nothing was written")
    assert_nothing_half_written(tmp_path / "data_cache")
    assert not (tmp_path / "run").exists()
    # and the rerun says the same (no 0-row cache to trip over)
    assert_one_line_error(recsys_train(tmp_path, overrides(tmp_path, empty)), f"{empty}: no valid rows (0 rows read); nothing was written")


def test_only_bad_rows_is_no_rows(tmp_path, kaggle_lines):
    junk = write(tmp_path / "junk.tsv", ["a\tb\n"] * 3)
    with pytest.raises(DataFileError) as e:
        rf.preprocess_criteo(junk, tmp_path / "cache", max_bad_fraction=1.0)
    assert str(e.value) == f"{junk}: no valid rows (3 rows read); nothing was written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.tsv"]


def test_fewer_rows_than_one_global_batch(tmp_path, kaggle_lines):
    small = write(tmp_path / "small.tsv", kaggle_lines[:300])
    r = recsys_train(tmp_path, overrides(tmp_path, small, "train.batch_size=512"))
    assert_one_line_error(
        r,
        f"key 'data.path': {small} (300 rows) has 300 valid rows, 270 for training after "
        "data.eval_fraction=0.1: fewer than one global batch (train.batch_size=512)",
    )
    assert not (tmp_path / "run").exists()


def test_eval_split_smaller_than_the_world(tmp_path, kaggle_lines):
    small = write(tmp_path / "small.tsv", kaggle_lines[:300])
    r = recsys_train(tmp_path, overrides(tmp_path, small, "data.eval_fraction=0.001", "train.nproc_per_node=2"))
    assert_one_line_error(
        r,
        f"key 'data.path': {small} (300 rows) has 300 valid rows, 0 for evaluation "
        "(data.eval_fraction=0.001): fewer than one per rank (2 ranks)",
    )


def test_multi_file_counts_are_named(tmp_path, kaggle_lines):
    d = tmp_path / "days"
    write(d / "day_0.tsv", kaggle_lines[:100])
    write(d / "day_1.tsv", kaggle_lines[100:250])
    r = recsys_train(tmp_path, overrides(tmp_path, d, "train.batch_size=256"))
    assert_one_line_error(
        r,
        f"key 'data.path': {d / 'day_0.tsv'} (100 rows), {d / 'day_1.tsv'} (150 rows) have 250 valid rows, "
        "225 for training after data.eval_fraction=0.1: fewer than one global batch (train.batch_size=256)",
    )


def test_steps_per_epoch_refuses_zero(tmp_path, kaggle_lines):
    """The workers' guard (if the launcher's check was bypassed): counts, not ZeroDivisionError."""
    small = write(tmp_path / "small.tsv", kaggle_lines[:100])
    cfg = load_config(SMOKE, overrides(tmp_path, small, f"data.cache_dir={tmp_path / 'c'}"))
    rf.preprocess_criteo(small, tmp_path / "c")
    with pytest.raises(ValueError) as e:
        steps_per_epoch(ShardSource(cfg, tmp_path / "c"), TRAIN, 128)
    assert str(e.value) == "the training split has 90 rows, fewer than one global batch of 128"


# ---------------------------------------------------------------------------------------------
# 3. broken files and a full disk: one line naming the file, nothing half-written
# ---------------------------------------------------------------------------------------------


def test_truncated_gzip(tmp_path, kaggle_lines):
    gz = tmp_path / "day.tsv.gz"
    gz.write_bytes(gzip.compress("".join(kaggle_lines).encode())[:20_000])
    r = recsys_train(tmp_path, overrides(tmp_path, gz))
    assert_one_line_error(r, f"{gz}: truncated gzip file (the compressed stream ends early); nothing was written")
    assert_nothing_half_written(tmp_path / "data_cache")


def test_plain_text_named_gz(tmp_path, kaggle_lines):
    fake = write(tmp_path / "day.tsv.gz", kaggle_lines)
    r = recsys_train(tmp_path, overrides(tmp_path, fake))
    assert_one_line_error(r, f"{fake}: not a gzip file although named .gz; nothing was written")
    assert_nothing_half_written(tmp_path / "data_cache")


def test_corrupt_gzip_body(tmp_path, kaggle_lines):
    raw = bytearray(gzip.compress("".join(kaggle_lines).encode()))
    raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(64)  # zeros in the middle of the deflate stream
    gz = tmp_path / "day.tsv.gz"
    gz.write_bytes(bytes(raw))
    with pytest.raises(DataFileError) as e:
        rf.preprocess_criteo(gz, tmp_path / "cache")
    msg = str(e.value)
    assert msg.startswith(f"{gz}: corrupt gzip file (") and msg.endswith("; nothing was written"), msg
    assert "\n" not in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day.tsv.gz"]


def test_directory_where_a_file_is_expected(tmp_path, kaggle_lines):
    write(tmp_path / "days" / "day_0.tsv", kaggle_lines[:500])
    (tmp_path / "days" / "day_1.tsv").mkdir()
    r = recsys_train(tmp_path, overrides(tmp_path, tmp_path / "days" / "*.tsv"))
    assert_one_line_error(r, f"key 'data.path': {tmp_path / 'days' / 'day_1.tsv'} is a directory, not a data file")
    with pytest.raises(DataFileError) as e:
        rf.preprocess_criteo([tmp_path / "days" / "day_0.tsv", tmp_path / "days" / "day_1.tsv"], tmp_path / "c")
    assert str(e.value) == f"{tmp_path / 'days' / 'day_1.tsv'}: is a directory, not a data file; nothing was written"
    assert not (tmp_path / "c").exists()


def test_unreadable_file(tmp_path, kaggle_lines):
    """chmod 000: root reads it anyway, so as root the launcher runs as nobody (setpriv)."""
    as_nobody = os.geteuid() == 0
    if as_nobody and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a chmod 000 file stays readable")
    # pytest's own tmp dirs are private to root: work in one that nobody may enter
    work = Path(tempfile.mkdtemp(prefix="recsys-unreadable-"))
    try:
        work.chmod(0o777)
        locked = write(work / "locked.tsv", kaggle_lines)
        locked.chmod(0)
        r = recsys_train(work, overrides(work, locked), as_nobody=as_nobody)
        assert_one_line_error(r, f"{locked}: cannot read it (permission denied); nothing was written")
        assert sorted(p.name for p in work.iterdir()) == ["locked.tsv"]
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs (needs root); the test is skipped, with the reason, where mounting fails."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk_during_preprocessing(tmp_path, kaggle_lines, tiny_disk):
    day = write(tmp_path / "day.tsv", kaggle_lines)
    cache = tiny_disk / "cache"
    r = recsys_train(tmp_path, overrides(tmp_path, day, f"data.cache_dir={cache}"))
    assert "Traceback" not in r.stderr and r.returncode == 2
    (line,) = r.stderr.splitlines()
    # numpy reports a short write as "N requested and M written" (M depends on what fitted)
    pattern = (
        rf"error: {re.escape(str(cache))}: writing the shard cache failed at shard_00000\.\w+\.npy: "
        r"\d+ requested and \d+ written: is the disk full\? \(\d+ bytes free on that filesystem\); "
        r"nothing was written"
    )
    assert re.fullmatch(pattern, line), line
    assert list(tiny_disk.iterdir()) == []  # no temp dir, no partial cache
    # a direct call raises the same error, which is also an OSError
    with pytest.raises(CacheWriteError) as e:
        rf.preprocess_criteo(day, cache)
    assert isinstance(e.value, OSError) and re.fullmatch(pattern, f"error: {e.value}")
    assert list(tiny_disk.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# 4. config: one line, before launch
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_steps=-5", "key 'train.max_steps': -5 is negative (0: run train.epochs epochs)"),
        ("optim.dense_lr=.nan", "key 'optim.dense_lr': expected a finite number, got nan"),
        ("optim.embedding_lr=-.inf", "key 'optim.embedding_lr': expected a finite number, got -inf"),
        ("optim.adam_beta2=1.5", "key 'optim.adam_beta2': 1.5 is not in [0, 1)"),
        ("optim.embedding_eps=-1e-8", "key 'optim.embedding_eps': must be positive"),
        ("checkpoint.every_steps=-1", "key 'checkpoint.every_steps': must be >= 0 (0: only at the end)"),
    ],
)
def test_cli_refuses_impossible_numbers(tmp_path, override, message):
    r = recsys_train(tmp_path, [f"run_dir={tmp_path / 'run'}", override])
    prefix = f"override '{override}': " if "finite" in message else f"{SMOKE}: "
    assert_one_line_error(r, prefix + message)
    assert not (tmp_path / "run").exists()


def test_cli_checks_the_topology_against_the_run_before_launch(tmp_path):
    """A CUDA topology for a CPU run: one line naming the key, no worker started, nothing written."""
    r = recsys_train(
        tmp_path, [f"run_dir={tmp_path / 'run'}", "sharding.planner=topology", "sharding.topology=dgx-a100", "train.device=cpu"]
    )
    assert_one_line_error(r, "key 'sharding.topology': topology dgx-a100 is for cuda, the run is on cpu")
    assert not (tmp_path / "run").exists()


def test_cli_binary_config_and_run_dir_file(tmp_path):
    binary = tmp_path / "exp.yaml"
    binary.write_bytes(gzip.compress(b"name: x\n"))
    r = recsys_train(tmp_path, [], config=binary)
    assert_one_line_error(r, f"config file {binary} is not UTF-8 text (byte 0x8b at offset 1); is it a YAML file?")
    f = tmp_path / "taken"
    f.write_text("a file\n")
    r = recsys_train(tmp_path, [f"run_dir={f}"])
    assert_one_line_error(r, f"{SMOKE}: key 'run_dir': run directory {f} is an existing file, not a directory")
    assert f.read_text() == "a file\n"


def test_rows_missing_many_columns_are_counted_and_said(tmp_path, kaggle_lines, caplog):
    """Every row keeps 20 of 40 columns (label, 13 dense, 6 of 26 categorical): padded as empty,
    as the format allows, and one warning line counts them; 2-3 missing (stripped copies of the
    Kaggle file) stay an info line."""
    short = ["\t".join(line.rstrip("\n").split("\t")[:20]) + "\n" for line in kaggle_lines]
    day = write(tmp_path / "day.tsv", short)
    caplog.set_level(logging.INFO, logger="recsys.data.preprocess.raw_formats")
    m = rf.preprocess_criteo(day, tmp_path / "cache")
    assert m["num_rows"] == 1000 and m["sources"][0]["padded_fields"] == 20000
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "day.tsv: skipped 0 of 1000 rows; padded 1000 short rows whose trailing empty fields were missing (20000 "
        "fields in all, up to 20 in a row, read as empty)"
    ]
    caplog.clear()
    rf.preprocess_criteo(write(tmp_path / "kaggle.tsv", kaggle_lines), tmp_path / "cache2")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert (
        "padded 498 short rows whose trailing empty fields were missing (1025 fields in all, up to 3 in a row"
        in caplog.records[0].getMessage()
    )


def test_two_preprocessings_of_one_cache_wait_for_each_other(tmp_path, kaggle_lines):
    """While one process builds a cache (here: this test, holding the cache's lock while it puts a
    cache of the same input in place), a second `recsys preprocess` of the same config waits (one
    line says so), then finds the cache up to date: no "remove it" about the winner's cache."""
    day = write(tmp_path / "day.tsv", kaggle_lines)
    built = rf.preprocess_criteo(day, tmp_path / "elsewhere")  # the same key: the same input and options
    cache = tmp_path / "cache"
    cmd = [
        sys.executable,
        "-m",
        "recsys.cli",
        "preprocess",
        "--config",
        str(SMOKE),
        "data.source=criteo",
        f"data.path={day}",
        f"data.cache_dir={cache}",
    ]
    with rf.cache_lock(cache):
        second = subprocess.Popen(
            cmd, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        waiting = second.stderr.readline()  # printed just before it blocks on the lock
        shutil.copytree(tmp_path / "elsewhere", cache)
    out, err = second.communicate(timeout=120)
    assert waiting.strip() == f"{cache}: another process is preprocessing into this cache; waiting for it"
    assert second.returncode == 0 and err == "", err
    assert out.strip() == f"task 0 of 1: {cache} holds {built['num_rows']} rows in {len(built['shards'])} shards"


def test_data_identity_compares_whole_file_hashes_where_both_sides_have_them():
    """A checkpoint written with a cache from before whole-file hashes, resumed after the cache was
    rebuilt with them (same file): the same data, judged by the head/tail hashes both sides have.
    Two whole-file hashes that differ, or head/tail hashes that differ: other content."""
    from recsys.data.identity import describe_data_change

    def entry(**k):
        return {"name": "d.tsv", "bytes": 10, "rows": 5, "sha256": None, "head_tail": "a b", **k}

    base = {"source": "criteo", "options": {"kind": "criteo"}, "rows": 5, "eval_fraction": 0.1}
    with_hash = dict(base, files=[entry(sha256="x")])
    assert describe_data_change(dict(base, files=[entry()]), with_hash) is None
    assert describe_data_change(dict(base, files=[entry(sha256="y")]), with_hash) == "d.tsv: other content, same size"
    assert (
        describe_data_change(dict(base, files=[entry()]), dict(base, files=[entry(head_tail="c d")])) == "d.tsv: other content, same size"
    )
    assert describe_data_change(with_hash, dict(base, files=[entry(sha256="x", rows=4)])) == "d.tsv: 5 rows, 10 bytes -> 4 rows, 10 bytes"
    assert describe_data_change(with_hash, dict(with_hash, eval_fraction=0.2)) == "data.eval_fraction 0.1 -> 0.2"
