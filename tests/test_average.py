"""`ecomla average`: the written floating weights are the mean of the inputs', integer buffers the shared value,
the config and tokenizer the first's, sharded inputs read like single files; other configs, names or shapes, an
unequal integer buffer, too few checkpoints, an existing output and an output that holds an input are refused,
naming what is wrong, with nothing written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from ecomla.average import AverageError, average_checkpoints
from ecomla.io.checkpoint import AtomicCheckpointWriter, CheckpointReader

CONFIG = {"model_type": "deepseek_v3", "hidden_size": 4}


def checkpoint(path, seed: int, shape=(3, 4), config=None, step=7, sharded=False) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {"w": torch.randn(shape, generator=g), "b": torch.randn(4, generator=g).to(torch.bfloat16),
          "step": torch.tensor([step])}
    if sharded:  # one tensor a shard, with an index, as large checkpoints are saved
        with AtomicCheckpointWriter(path, overwrite=False, shard_bytes=1) as w:
            for k, v in sd.items():
                w.add(k, v)
            w.commit()
        assert (path / "model.safetensors.index.json").is_file()
    else:
        path.mkdir()
        save_file(sd, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({**(config or CONFIG), "transformers_version": f"5.{seed}"}))
    (path / "tokenizer.json").write_text(f'{{"seed": {seed}}}')
    return sd


def test_the_average_is_the_mean_in_the_firsts_dtype_with_the_firsts_files(tmp_path):
    sds = [checkpoint(tmp_path / f"c{i}", i, sharded=i == 1) for i in range(3)]
    ins = [str(tmp_path / f"c{i}") for i in range(3)]
    subprocess.run([sys.executable, "-m", "ecomla", "average", str(tmp_path / "soup"), *ins], check=True,
                   capture_output=True)
    got = load_file(tmp_path / "soup" / "model.safetensors")
    torch.testing.assert_close(got["w"], sum(sd["w"] for sd in sds) / 3, rtol=0, atol=1e-6)
    assert not torch.equal(got["w"], sds[0]["w"])
    assert got["b"].dtype == torch.bfloat16
    assert torch.equal(got["b"], (sum(sd["b"].double() for sd in sds) / 3).to(torch.bfloat16))
    assert torch.equal(got["step"], torch.tensor([7]))  # an integer buffer, the same in all, copied
    assert (tmp_path / "soup" / "tokenizer.json").read_text() == '{"seed": 0}'
    assert json.loads((tmp_path / "soup" / "config.json").read_text())["transformers_version"] == "5.0"
    assert json.loads((tmp_path / "soup" / "average.json").read_text())["average_of"] == ins


@pytest.mark.parametrize("second, message", [
    ({"shape": (4, 4)}, r"w is \[4, 4\] in .*b and \[3, 4\] in .*a"),
    ({"config": {**CONFIG, "hidden_size": 8}}, "differs from .* in hidden_size"),
    ({"step": 8}, "step .*differs between the checkpoints and is not a floating tensor"),
])
def test_other_models_are_refused_with_what_differs_and_nothing_written(tmp_path, second, message):
    checkpoint(tmp_path / "a", 0)
    checkpoint(tmp_path / "b", 1, **second)
    with pytest.raises(AverageError, match=message):
        average_checkpoints(tmp_path / "soup", [tmp_path / "a", tmp_path / "b"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_an_output_in_the_way_is_refused_and_force_replaces_only_an_output(tmp_path):
    checkpoint(tmp_path / "a", 0)
    checkpoint(tmp_path / "b", 1)
    ab = [tmp_path / "a", tmp_path / "b"]
    with pytest.raises(AverageError, match="at least two"):
        average_checkpoints(tmp_path / "soup", ab[:1])
    for out in (tmp_path / "b", tmp_path):  # an input itself, or a directory that holds one
        with pytest.raises(AverageError, match="would delete"):
            average_checkpoints(out, ab, force=True)
    assert CheckpointReader(tmp_path / "b").names() == {"w", "b", "step"}
    average_checkpoints(tmp_path / "soup", ab)
    with pytest.raises(AverageError, match="exists"):
        average_checkpoints(tmp_path / "soup", ab)
    (tmp_path / "soup" / "stale.txt").write_text("from before")
    average_checkpoints(tmp_path / "soup", ab, force=True)
    assert not (tmp_path / "soup" / "stale.txt").exists()  # replaced whole, not written into
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "soup"]
