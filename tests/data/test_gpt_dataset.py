"""GPTDataset: packing, epochs, shuffling, splits and the cached index."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tpcore.data import GPTDataset, IndexedDataset, IndexedDatasetBuilder, split_documents


@pytest.fixture
def corpus(tmp_path):
    """20 documents of varied length (one empty) with globally unique token ids."""
    rng = np.random.RandomState(0)
    prefix, next_id, docs = str(tmp_path / "c"), 0, []
    with IndexedDatasetBuilder(prefix, np.int32) as b:
        for i in range(20):
            n = 0 if i == 7 else int(rng.randint(1, 40))
            docs.append(list(range(next_id, next_id + n)))
            next_id += n
            b.add_document(docs[-1])
    return IndexedDataset(prefix), docs


def test_samples_are_windows_of_the_shuffled_stream(corpus):
    indexed, docs = corpus
    seq = 16
    ds = GPTDataset(indexed, seq, num_samples=50, valid_fraction=0.2, seed=3)
    train_docs = [d for d in docs[:16]]
    stream = np.concatenate([np.asarray(docs[i], np.int64) for i in ds.order])
    per_epoch_tokens = sum(len(d) for d in train_docs)
    assert len(ds.order) % 16 == 0 and len(stream) == per_epoch_tokens * (len(ds.order) // 16)
    for epoch in range(len(ds.order) // 16):  # each epoch is a permutation of the train documents
        assert sorted(ds.order[epoch * 16 : (epoch + 1) * 16].tolist()) == list(range(16))
    seen = set()
    for i in range(len(ds)):
        sample = ds[i].numpy()
        k = int(ds.shuffle[i])
        assert sample.shape == (seq + 1,) and sample.dtype == np.int64
        assert np.array_equal(sample, stream[k * seq : k * seq + seq + 1]), f"sample {i}"
        seen.add(k)
    assert seen == set(range(50)), "every sample is visited once"


def test_deterministic_and_cached(corpus):
    indexed, _ = corpus
    a = GPTDataset(indexed, 8, 30, seed=5)
    assert os.path.isfile(a.cache_path)
    stamp = os.stat(a.cache_path).st_mtime_ns
    b = GPTDataset(indexed, 8, 30, seed=5)
    assert os.stat(a.cache_path).st_mtime_ns == stamp, "the cached index is reused"
    assert all(np.array_equal(a[i], b[i]) for i in range(30))
    c = GPTDataset(indexed, 8, 30, seed=6)
    assert any(not np.array_equal(a[i], c[i]) for i in range(30))
    with open(a.cache_path, "wb") as f:
        f.write(b"garbage")  # a corrupt cache is rebuilt, not trusted
    d = GPTDataset(indexed, 8, 30, seed=5)
    assert all(np.array_equal(a[i], d[i]) for i in range(30))


def test_splits_are_disjoint(corpus):
    indexed, docs = corpus
    train = GPTDataset(indexed, 4, 20, split="train", valid_fraction=0.25, cache=False)
    valid = GPTDataset(indexed, 4, 5, split="valid", valid_fraction=0.25, cache=False)
    train_tokens = {t for i in range(len(train)) for t in train[i].tolist()}
    valid_tokens = {t for i in range(len(valid)) for t in valid[i].tolist()}
    assert train_tokens.isdisjoint(valid_tokens)
    assert valid_tokens <= {t for d in docs[15:] for t in d}
    assert split_documents(20, 0.25) == {"train": (0, 15), "valid": (15, 20)}


def test_errors(corpus):
    indexed, _ = corpus
    with pytest.raises(ValueError, match="fewer than one sample"):
        GPTDataset(indexed, 10_000, 1, cache=False)
    with pytest.raises(ValueError, match="split must be"):
        GPTDataset(indexed, 8, 1, split="test", cache=False)
    with pytest.raises(IndexError, match="out of range"):
        GPTDataset(indexed, 8, 3, cache=False)[3]


def test_a_data_folder_that_cannot_be_written_only_costs_the_cache(corpus, monkeypatch):
    """Read-only data (shared clusters): the index is built, a warning names the problem."""
    import errno

    from tpcore.data import gpt_dataset

    indexed, _ = corpus
    expected = GPTDataset(indexed, 8, 30, seed=7, cache=False)

    def read_only(path):
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(gpt_dataset, "atomic_output", read_only)
    with pytest.warns(UserWarning, match="cannot cache the sample index.*Read-only"):
        got = GPTDataset(indexed, 8, 30, seed=7)
    assert not os.path.exists(got.cache_path)
    assert all(np.array_equal(expected[i], got[i]) for i in range(30))


def test_the_index_cache_can_live_in_a_folder_of_its_own(corpus, tmp_path_factory):
    """--data-cache-path: nothing is written beside the data; the cache is reused from the
    folder; a second dataset of the same name and size elsewhere gets a file of its own."""
    indexed, docs = corpus
    data_dir = os.path.dirname(indexed.prefix)
    before = sorted(os.listdir(data_dir))
    cache = str(tmp_path_factory.mktemp("cache") / "nested")
    a = GPTDataset(indexed, 8, 30, seed=5, cache_dir=cache)
    assert sorted(os.listdir(data_dir)) == before, "the data folder is not written"
    assert os.path.dirname(a.cache_path) == cache and os.path.isfile(a.cache_path)
    stamp = os.stat(a.cache_path).st_mtime_ns
    b = GPTDataset(indexed, 8, 30, seed=5, cache_dir=cache)
    assert os.stat(a.cache_path).st_mtime_ns == stamp, "the cached index is reused"
    plain = GPTDataset(indexed, 8, 30, seed=5, cache=False)
    assert all(np.array_equal(plain[i], x[i]) for x in (a, b) for i in range(30))
    other_dir = tmp_path_factory.mktemp("other")
    with IndexedDatasetBuilder(
        str(other_dir / "c"), np.int32
    ) as builder:  # same name, length and token count
        for d in reversed(docs):
            builder.add_document(d)
    other = GPTDataset(IndexedDataset(str(other_dir / "c")), 8, 30, seed=5, cache_dir=cache)
    assert other.cache_path != a.cache_path
    assert any(not np.array_equal(other[i], a[i]) for i in range(30))


def test_data_made_again_in_place_does_not_reuse_the_old_index(corpus):
    """Same name, document count and token count, documents reordered: a new index."""
    indexed, docs = corpus
    old = GPTDataset(indexed, 8, 30, seed=5)
    with IndexedDatasetBuilder(indexed.prefix, np.int32) as builder:
        for d in docs[-2::-1] + docs[-1:]:  # the train split (all but the last) reversed
            builder.add_document(d)
    again = IndexedDataset(indexed.prefix)
    new = GPTDataset(again, 8, 30, seed=5)
    assert new.cache_path != old.cache_path
    expected = GPTDataset(again, 8, 30, seed=5, cache=False)
    assert all(np.array_equal(new[i], expected[i]) for i in range(30))
