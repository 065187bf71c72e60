"""Indexed dataset (.bin/.idx, Megatron-LM's layout): round trips, the spec, corrupt files."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from tpcore.data import IndexedDataset, IndexedDatasetBuilder, best_token_dtype

DOCS = [[5, 6, 7], [], [1], list(range(1000, 1300))]


def _spec_write(prefix, sequences, doc_idx, dtype_code, dtype, version=1, magic=b"MMIDIDX\x00\x00"):
    """Write a dataset straight from the format description (docs/indexed_dataset_format.md)."""
    data = [np.asarray(s, dtype=dtype) for s in sequences]
    with open(prefix + ".bin", "wb") as f:
        for d in data:
            f.write(d.tobytes())
    sizes = np.array([d.size for d in data], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum([d.nbytes for d in data])[:-1]]).astype(np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(magic + struct.pack("<Q", version) + struct.pack("<B", dtype_code))
        f.write(struct.pack("<Q", len(data)) + struct.pack("<Q", len(doc_idx)))
        f.write(
            sizes.tobytes() + pointers.tobytes() + np.asarray(doc_idx, dtype=np.int64).tobytes()
        )


def _spec_read(prefix):
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n, d = struct.unpack("<QBQQ", raw[9:34])
    sizes = np.frombuffer(raw, np.int32, n, 34)
    pointers = np.frombuffer(raw, np.int64, n, 34 + 4 * n)
    doc_idx = np.frombuffer(raw, np.int64, d, 34 + 12 * n)
    return version, code, sizes, pointers, doc_idx


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.int64, 5)])
def test_round_trip_and_layout(tmp_path, dtype, code):
    prefix = str(tmp_path / "ds")
    with IndexedDatasetBuilder(prefix, dtype) as b:
        for doc in DOCS:
            b.add_document(doc)
    version, got_code, sizes, pointers, doc_idx = _spec_read(prefix)
    assert (version, got_code) == (1, code)
    assert sizes.tolist() == [len(d) for d in DOCS]
    assert pointers.tolist() == (np.array([0, 3, 3, 4]) * np.dtype(dtype).itemsize).tolist()
    assert doc_idx.tolist() == list(range(len(DOCS) + 1))
    ds = IndexedDataset(prefix)
    assert len(ds) == len(DOCS) and ds.dtype == np.dtype(dtype)
    for i, doc in enumerate(DOCS):
        assert ds[i].tolist() == doc
    assert ds.get(3, offset=10, length=5).tolist() == list(range(1010, 1015))
    with pytest.raises(IndexError, match="out of range"):
        ds[4]
    with pytest.raises(IndexError, match="outside sequence 0"):
        ds.get(0, offset=2, length=5)


def test_reads_a_file_written_from_the_spec(tmp_path):
    """Several sequences per document, as Megatron's sentence-split datasets have."""
    prefix = str(tmp_path / "meg")
    sequences = [[1, 2], [3], [4, 5, 6], [7]]
    _spec_write(prefix, sequences, [0, 2, 4], 4, np.int32)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == sequences
    assert ds.doc_idx.tolist() == [0, 2, 4]
    assert ds.sizes.tolist() == [2, 1, 3, 1]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(magic=b"NOTANIDX\x00"), "bad magic"),
        (dict(version=2), "unsupported index version 2"),
        (dict(dtype_code=9), "unknown dtype code 9"),
    ],
)
def test_bad_header(tmp_path, kwargs, match):
    prefix = str(tmp_path / "bad")
    _spec_write(prefix, [[1, 2, 3]], [0, 1], **{"dtype_code": 4, "dtype": np.int32, **kwargs})
    with pytest.raises(ValueError, match=match) as err:
        IndexedDataset(prefix)
    assert prefix + ".idx" in str(err.value)


def test_truncated_files(tmp_path):
    prefix = str(tmp_path / "t")
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for doc in DOCS:
            b.add_document(doc)
    idx = open(prefix + ".idx", "rb").read()
    binary = open(prefix + ".bin", "rb").read()
    open(prefix + ".idx", "wb").write(idx[:-3])
    with pytest.raises(ValueError, match=r"t\.idx: index is .* truncated or corrupt"):
        IndexedDataset(prefix)
    open(prefix + ".idx", "wb").write(idx[:20])
    with pytest.raises(ValueError, match="truncated index"):
        IndexedDataset(prefix)
    open(prefix + ".idx", "wb").write(idx)
    open(prefix + ".bin", "wb").write(binary[:-2])
    with pytest.raises(ValueError, match=r"t\.bin: 606 bytes but .*t\.idx describes 608 bytes"):
        IndexedDataset(prefix)
    with pytest.raises(FileNotFoundError, match=r"give the prefix without the extension: .*/t\)"):
        IndexedDataset(prefix + ".bin")  # the file, not the prefix
    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=r"t\.bin does not exist$"):
        IndexedDataset(prefix)


def test_failed_build_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "f")
    with pytest.raises(
        ValueError,
        match=(
            r"token id 70000 is outside the range of uint16 \[0, 65535\] "
            r"\(a larger vocabulary needs dtype=np.int32"
        ),
    ):
        with IndexedDatasetBuilder(prefix, np.uint16) as b:
            b.add_document([1, 2])
            b.add_document([70000])
    assert os.listdir(tmp_path) == []


def test_best_token_dtype():
    assert best_token_dtype(50257) == np.uint16
    assert best_token_dtype(128256) == np.int32


def _build(prefix, docs, dtype=np.uint16):
    with IndexedDatasetBuilder(prefix, dtype) as b:
        for doc in docs:
            b.add_document(doc)
    return prefix


def _patch_idx(prefix, offset, value_bytes):
    """Overwrite bytes of `prefix.idx` at `offset` (the header is 34 bytes, then sizes,
    pointers, doc index)."""
    with open(prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(value_bytes)


def test_index_must_describe_the_bin_exactly(tmp_path):
    """Every sequence inside `.bin` is not enough: an unrelated `.idx` of a smaller dataset, or a
    dtype byte changed to a narrower type, points only inside `.bin` and trained on misaligned
    text. The reader checks the exact size and the pointers against sizes x itemsize."""
    big = _build(str(tmp_path / "big"), DOCS)
    small = _build(str(tmp_path / "small"), [[1, 2], [3]])
    os.replace(small + ".idx", big + ".idx")  # an unrelated index beside big.bin
    with pytest.raises(ValueError) as err:
        IndexedDataset(big)
    message = str(err.value)
    assert big + ".bin" in message and "608 bytes" in message and "6 bytes" in message, message
    # The dtype byte of a uint16 dataset changed to uint8 (code 1): pointers are in bytes of uint16.
    prefix = _build(str(tmp_path / "dt"), DOCS)
    _patch_idx(prefix, 9 + 8, struct.pack("<B", 1))
    with pytest.raises(
        ValueError,
        match=r"dt\.idx: sequence 1 starts at byte 6 but the sequences before it end at byte 3",
    ):
        IndexedDataset(prefix)
    # One sequence, dtype changed from uint16 to int32: the only check left is the size.
    prefix = _build(str(tmp_path / "one"), [[1, 2, 3, 4]])
    _patch_idx(prefix, 9 + 8, struct.pack("<B", 4))
    with pytest.raises(ValueError, match=r"one\.bin: 8 bytes but .*one\.idx describes 16"):
        IndexedDataset(prefix)


@pytest.mark.parametrize(
    "field, index, value, match",
    [
        ("sizes", 0, -1, r"sequence 0 has a negative size -1"),
        (
            "pointers",
            0,
            2,
            r"sequence 0 starts at byte 2 but the sequences before it end at byte 0",
        ),
        (
            "pointers",
            2,
            0,
            r"sequence 2 starts at byte 0 but the sequences before it end at byte 6",
        ),
        ("doc_idx", 1, 7, r"document index entry 1 is 7, outside \[0, 4\]"),
        ("doc_idx", 3, 1, r"document index is not sorted \(entry 3 is 1 after 2\)"),
        ("doc_idx", 0, 1, r"document index must start at 0, got 1"),
    ],
)
def test_index_arrays_are_checked(tmp_path, field, index, value, match):
    prefix = _build(str(tmp_path / "ds"), DOCS)
    n = len(DOCS)
    offset, fmt = {
        "sizes": (34, "<i"),
        "pointers": (34 + 4 * n, "<q"),
        "doc_idx": (34 + 12 * n, "<q"),
    }[field]
    size = struct.calcsize(fmt)
    _patch_idx(prefix, offset + index * size, struct.pack(fmt, value))
    with pytest.raises(ValueError, match=match) as err:
        IndexedDataset(prefix)
    assert prefix + ".idx" in str(err.value)
