"""Reading a raw file as blocks of whole lines: cut only after a newline, numbered by physical
line, the layout settled from a header (or the default one), .gz read on the fly, and a broken
.gz reported as one line naming the file."""

from __future__ import annotations

import gzip
import re

import pytest

from recsys.data.errors import DataFileError
from recsys.data.preprocess.read_blocks import BOM, BlockReader, Layout, column_mapping, first_line, header_names

COLUMNS = ["label", "a", "b", "c"]


def _reader(path, block_bytes=8, wanted=("label", "c", "a")) -> BlockReader:
    return BlockReader(path, b",", list(wanted), COLUMNS, block_bytes)


def test_blocks_hold_whole_lines_numbered_from_the_file(tmp_path):
    lines = [b"1,10,20,30", b"0,11,21,31", b"", b"1,12,22,32", b"0,13,23,33"]
    f = tmp_path / "a.csv"
    f.write_bytes(b"\n".join(lines))  # the last line has no newline
    r = _reader(f)
    assert r.layout == Layout(b",", 4, (0, 3, 1), header=False)  # the default layout, wanted columns picked
    assert r.progress == 0.0
    blocks, progress = [], []
    for b in r.blocks():
        blocks.append(b)
        progress.append(r.progress)
    assert b"".join(b.data for b in blocks) == f.read_bytes()
    assert all(b.data.endswith(b"\n") for b in blocks[:-1]) and blocks[-1].data == b"0,13,23,33"
    for b in blocks:  # each block's first line is the line with that number in the file
        assert b.data.split(b"\n")[0] == lines[b.first_lineno - 1]
    assert progress == sorted(progress) and progress[-1] == 1.0  # the share of the file read, for the progress line


def test_a_header_fixes_the_layout_and_starts_the_numbering_at_line_2(tmp_path):
    f = tmp_path / "h.csv"
    f.write_bytes(BOM + b'"C",Label,b,a,extra\r\n30,1,20,10,x\r\n31,0,21,11,y\r\n')
    r = _reader(f, block_bytes=1 << 20)
    blocks = list(r.blocks())
    assert r.layout == Layout(b",", 5, (1, 0, 3), header=True)
    assert [(b.first_lineno, b.data) for b in blocks] == [(2, b"30,1,20,10,x\r\n31,0,21,11,y\r\n")]


def test_gz_files_are_read_decompressed(tmp_path):
    data = b"".join(b"%d,%d,%d,%d\n" % (i % 2, i, i + 1, i + 2) for i in range(200))
    f = tmp_path / "a.csv.gz"
    f.write_bytes(gzip.compress(data))
    blocks = list(_reader(f, block_bytes=100).blocks())
    assert b"".join(b.data for b in blocks) == data
    assert [b.first_lineno for b in blocks] == [1 + sum(x.data.count(b"\n") for x in blocks[:k]) for k in range(len(blocks))]


def test_a_truncated_gz_is_one_line_naming_it(tmp_path):
    f = tmp_path / "a.csv.gz"
    f.write_bytes(gzip.compress(b"1,2,3,4\n" * 5000)[:-40])
    with pytest.raises(DataFileError, match=re.escape(f"{f}: truncated gzip file (the compressed stream ends early); nothing was written")):
        list(_reader(f, block_bytes=64).blocks())


def test_an_empty_file_has_no_blocks(tmp_path):
    f = tmp_path / "empty.csv"
    f.write_bytes(b"")
    assert list(_reader(f).blocks()) == [] and first_line(f) is None


def test_first_line_skips_blank_lines_bom_and_line_ending(tmp_path):
    f = tmp_path / "a.tsv"
    f.write_bytes(b"\r\n  \n" + b"1\t2\r\n3\n")
    assert first_line(f) == b"1\t2"
    g = tmp_path / "b.csv"
    g.write_bytes(BOM + b"label,I1\n")
    assert first_line(g) == b"label,I1"


def test_header_names_and_column_mapping(tmp_path):
    assert header_names(b" \"Label\" ,'I1', C1 ", b",") == ["label", "i1", "c1"]
    assert column_mapping(tmp_path, ["x", "label", "i1", "label"], ["I1", "LABEL"]) == (2, 1)  # the first of duplicates
    msg = f"{tmp_path}: header lacks columns ['c2'] (header: label,i1)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        column_mapping(tmp_path, ["label", "i1"], ["label", "c2"])
