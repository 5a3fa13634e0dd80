"""`ecomla average`: the written weights are the mean of the inputs', the config and tokenizer the first's; other
configs or shapes, too few checkpoints and an existing output are refused with nothing written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from ecomla.average import AverageError, average_checkpoints


def checkpoint(path, seed: int, shape=(3, 4), config=None) -> dict:
    path.mkdir()
    g = torch.Generator().manual_seed(seed)
    sd = {"w": torch.randn(shape, generator=g), "b": torch.randn(4, generator=g).to(torch.bfloat16)}
    save_file(sd, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config or {"model_type": "deepseek_v3"}))
    (path / "tokenizer.json").write_text(f'{{"seed": {seed}}}')
    return sd


def test_the_average_is_the_mean_in_the_firsts_dtype_with_the_firsts_files(tmp_path):
    sds = [checkpoint(tmp_path / f"c{i}", i) for i in range(3)]
    cli = [sys.executable, "-m", "ecomla", "average", str(tmp_path / "soup"), *(str(tmp_path / f"c{i}") for i in range(3))]
    subprocess.run(cli, check=True, capture_output=True)
    got = load_file(tmp_path / "soup" / "model.safetensors")
    torch.testing.assert_close(got["w"], sum(sd["w"] for sd in sds) / 3, rtol=0, atol=1e-6)
    assert got["b"].dtype == torch.bfloat16
    assert torch.equal(got["b"], (sum(sd["b"].double() for sd in sds) / 3).to(torch.bfloat16))
    assert not torch.equal(got["w"], sds[0]["w"])
    assert (tmp_path / "soup" / "tokenizer.json").read_text() == '{"seed": 0}'
    assert json.loads((tmp_path / "soup" / "config.json").read_text()) == {"model_type": "deepseek_v3"}


@pytest.mark.parametrize("second, message", [
    ({"shape": (4, 4)}, "other tensors or shapes"),
    ({"config": {"model_type": "llama"}}, "config.json differs"),
])
def test_other_architectures_are_refused_with_nothing_written(tmp_path, second, message):
    checkpoint(tmp_path / "a", 0)
    checkpoint(tmp_path / "b", 1, **second)
    with pytest.raises(AverageError, match=message):
        average_checkpoints(tmp_path / "soup", [tmp_path / "a", tmp_path / "b"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_one_checkpoint_and_an_existing_output_are_refused(tmp_path):
    checkpoint(tmp_path / "a", 0)
    checkpoint(tmp_path / "b", 1)
    with pytest.raises(AverageError, match="at least two"):
        average_checkpoints(tmp_path / "soup", [tmp_path / "a"])
    with pytest.raises(AverageError, match="exists"):
        average_checkpoints(tmp_path / "b", [tmp_path / "a", tmp_path / "b"])
    with pytest.raises(AverageError, match="one of the checkpoints"):
        average_checkpoints(tmp_path / "b", [tmp_path / "a", tmp_path / "b"], force=True)
    before = load_file(tmp_path / "b" / "model.safetensors")
    average_checkpoints(tmp_path / "soup", [tmp_path / "a", tmp_path / "b"])
    average_checkpoints(tmp_path / "soup", [tmp_path / "a", tmp_path / "b"], force=True)  # replaced whole
    assert torch.equal(load_file(tmp_path / "b" / "model.safetensors")["w"], before["w"])
