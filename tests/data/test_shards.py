"""`ecomla.data.shards`: the prepared-dataset format, written atomically and read back by memmap.

Proves: sequences written through `ShardWriter` (across several shards, the last
one trimmed) read back from `PackedDataset` exactly as `pack_to_memory` holds
them, item by item and as batches; meta.json counts tokens and targets right;
an exception inside the writer leaves neither the output nor a temp directory;
an existing output is refused unless overwrite; broken directories fail clearly.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from ecomla.data.packing import pack, target_mask, text_documents
from ecomla.data.shards import (
    InMemoryPacked,
    PackedDataset,
    ShardWriter,
    pack_to_memory,
)
from ecomla.data.text import DataError, iter_texts

SEQ_LEN = 64


@pytest.fixture(scope="module")
def docs(tokenizer_dir, corpus_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return list(text_documents(iter_texts(str(corpus_dir / "b_fit.jsonl")), tok))


def write(out, docs, per_shard=100, **kw):
    with ShardWriter(out, SEQ_LEN, sequences_per_shard=per_shard, meta={"tokenizer": "tiny", "vocab_size": 320}, **kw) as w:
        w.write_all(pack(docs, SEQ_LEN, pad_id=0))
    return out


def test_write_read_back_equals_memory(tmp_path, docs):
    mem = pack_to_memory(docs, SEQ_LEN, pad_id=0)
    ds = PackedDataset(write(tmp_path / "ds", docs))
    assert len(ds) == len(mem) > 200 and len(ds) % 100 != 0  # several shards and a trimmed last one
    assert ds.seq_len == SEQ_LEN
    for i in range(len(ds)):
        a, b = ds[i], mem[i]
        assert a.keys() == b.keys() == {"tokens", "loss_mask", "segments"}
        for k in a:
            assert torch.equal(a[k], b[k])
    assert ds[0]["tokens"].dtype == torch.long and ds[0]["loss_mask"].dtype == torch.bool
    idx = [len(ds) - 1, 0, 108, 3]  # crosses shards, out of order
    got, want = ds.batch(idx), mem.batch(idx)
    assert got["tokens"].shape == (4, SEQ_LEN)
    for k in got:
        assert torch.equal(got[k], want[k])
    clone = pickle.loads(pickle.dumps(ds))  # DataLoader workers reopen the memmaps themselves
    assert torch.equal(clone[5]["tokens"], ds[5]["tokens"])


def test_meta_counts(tmp_path, docs):
    out = write(tmp_path / "ds", docs)
    meta = json.loads((out / "meta.json").read_text())
    n_tokens = sum(len(d.ids) for d in docs)
    seqs = list(pack(docs, SEQ_LEN, pad_id=0))
    seg = torch.from_numpy(np.stack([s.segments for s in seqs]).astype(np.int64))
    loss = torch.from_numpy(np.stack([s.loss_mask for s in seqs]))
    assert meta["seq_len"] == SEQ_LEN and meta["num_sequences"] == len(seqs)
    assert meta["num_tokens"] == n_tokens
    # Every piece of a document (documents longer than SEQ_LEN are cut) has one token that is not a target.
    pieces = sum(-(-len(d.ids) // SEQ_LEN) for d in docs)
    assert pieces > len(docs)  # some documents were cut
    assert meta["target_tokens"] == int(target_mask(seg, loss).sum()) == n_tokens - pieces
    assert [s["num_sequences"] for s in meta["shards"]] == [100] * (len(seqs) // 100) + [len(seqs) % 100]
    assert meta["tokenizer"] == "tiny" and meta["vocab_size"] == 320
    assert sorted(p.name for p in out.iterdir()) == ["meta.json"] + [s["name"] for s in meta["shards"]]


def test_exception_leaves_nothing(tmp_path, docs):
    with pytest.raises(RuntimeError, match="boom"), ShardWriter(tmp_path / "ds", SEQ_LEN, sequences_per_shard=10) as w:
        w.write_all(pack(docs[:30], SEQ_LEN, pad_id=0))
        assert w.num_sequences > 10  # a shard was finished before the failure
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_existing_dir_refused_unless_overwrite(tmp_path, docs):
    out = write(tmp_path / "ds", docs[:10])
    with pytest.raises(DataError, match="already exists"):
        ShardWriter(out, SEQ_LEN)
    write(out, docs, overwrite=True)
    assert len(PackedDataset(out)) == len(pack_to_memory(docs, SEQ_LEN, 0))
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]  # no temp or old directory left


def test_empty_source_writes_nothing(tmp_path):
    with pytest.raises(DataError, match="no sequences"), ShardWriter(tmp_path / "ds", SEQ_LEN):
        pass
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataError, match="no packed sequences"):
        InMemoryPacked([], SEQ_LEN)


def test_broken_dataset_dirs(tmp_path, docs):
    with pytest.raises(DataError, match="no such dataset"):
        PackedDataset(tmp_path / "nope")
    (tmp_path / "half").mkdir()
    with pytest.raises(DataError, match="no meta.json"):
        PackedDataset(tmp_path / "half")
    out = write(tmp_path / "ds", docs)
    (out / "shard_00001" / "segments.npy").unlink()
    with pytest.raises(DataError, match="missing"):
        PackedDataset(out)
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "shards": []}))
    with pytest.raises(DataError, match="empty"):
        PackedDataset(out)
