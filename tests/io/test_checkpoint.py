"""Streaming checkpoint I/O: sharded atomic writes that HF loads, and lazy reads that can unmap."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ecomla.io.checkpoint import AtomicCheckpointWriter, CheckpointReader


def test_sharded_write_loads_and_reads_back(source_factory, tmp_path):
    src = source_factory("llama")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with AtomicCheckpointWriter(tmp_path / "out", overwrite=False, shard_bytes=20_000) as w:
        for name, t in model.state_dict().items():
            w.add(name, t)
        model.config.save_pretrained(w.path)
        w.commit()
    shards = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "out" / "model.safetensors.index.json").exists()
    assert shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    for (n, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), n
    reader = CheckpointReader(tmp_path / "out")
    name = "model.layers.1.mlp.up_proj.weight"
    first = reader.get(name)
    reader.release()  # unmapped; the next read reopens the shard
    assert torch.equal(reader.get(name), first) and torch.equal(first, model.state_dict()[name])
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_writer_refuses_existing_and_cleans_up(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="--force"):
        AtomicCheckpointWriter(tmp_path / "out", overwrite=False)
    with pytest.raises(RuntimeError):
        with AtomicCheckpointWriter(tmp_path / "new", overwrite=False) as w:
            w.add("x", torch.zeros(3))
            raise RuntimeError("boom")
    assert not (tmp_path / "new").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_stored_dtype_from_headers(source_factory, tmp_path):
    src = source_factory("llama")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert CheckpointReader(src).stored_dtype() == torch.float32
    assert CheckpointReader(tmp_path / "bf16").stored_dtype() == torch.bfloat16
