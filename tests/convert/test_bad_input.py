"""Bad input fails before compute with one clear error, through the CLI, and leaves nothing behind."""

from __future__ import annotations

import json

import pytest
import yaml

from ecomla.cli import main
from ecomla.convert import mla as mla_transform


def _run(tmp_path, capsys, source, extra_args=(), **mla):
    recipe = {"model": str(source), "output_dir": str(tmp_path / "out"), "dtype": "float32", "device": "cpu",
              "mla": {"kv_lora_rank": 32, "qk_rope_head_dim": 8, **mla}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code = main(["convert", str(path), "--quiet", *extra_args])
    err = capsys.readouterr().err
    return code, err


def _nothing_written(tmp_path):
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]


@pytest.mark.parametrize(
    "family, cfg, needle",
    [
        ("qwen3", {}, "QK-norm"),
        ("mistral", {"sliding_window": 16}, "sliding_window=16"),
        ("mixtral", {"num_local_experts": 2, "num_experts_per_tok": 1}, "mixture-of-experts"),
    ],
)
def test_unsupported_source(source_factory, tmp_path, capsys, family, cfg, needle):
    src = source_factory(family, **cfg)
    code, err = _run(tmp_path, capsys, src)
    assert code == 2 and needle in err, err
    _nothing_written(tmp_path)


@pytest.mark.parametrize(
    "mla, needle",
    [
        ({"kv_lora_rank": 65}, "exceeds the hidden size 64"),
        ({"qk_rope_head_dim": 7}, "must be even"),
        ({"qk_rope_head_dim": 32}, "exceeds the source head dim 16"),
        ({"kv_lora_rank": None, "target_compression": 200.0}, "leaves no room"),
    ],
)
def test_bad_ranks(source_factory, tmp_path, capsys, mla, needle):
    code, err = _run(tmp_path, capsys, source_factory("llama"), **mla)
    assert code == 2 and needle in err, err
    _nothing_written(tmp_path)


def test_all_recipe_problems_at_once(source_factory, tmp_path, capsys):
    code, err = _run(tmp_path, capsys, source_factory("llama"), kv_lora_rnak=3, rope_dims="lats")
    assert code == 2
    assert "mla.kv_lora_rnak: unknown key; did you mean 'kv_lora_rank'?" in err
    assert "mla.rope_dims" in err and "did you mean 'last'" in err
    _nothing_written(tmp_path)


def test_set_override_goes_through_checks(source_factory, tmp_path, capsys):
    code, err = _run(tmp_path, capsys, source_factory("llama"), extra_args=["--set", "mla.kv_lora_rank=abc"])
    assert code == 2 and "mla.kv_lora_rank (from --set): expected int" in err, err


def test_existing_output_needs_force(source_factory, tmp_path, capsys):
    src = source_factory("llama")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    code, err = _run(tmp_path, capsys, src)
    assert code == 2 and "--force" in err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    code, _ = _run(tmp_path, capsys, src, extra_args=["--force"])
    assert code == 0
    assert (tmp_path / "out" / "config.json").exists() and not (tmp_path / "out" / "keep.txt").exists()


def test_missing_config(source_factory, tmp_path, capsys):
    src = source_factory("llama")
    (src / "config.json").unlink()
    code, err = _run(tmp_path, capsys, src)
    assert code == 2 and "config.json is missing" in err
    _nothing_written(tmp_path)


def test_corrupt_weights(source_factory, tmp_path, capsys):
    src = source_factory("llama")
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated download
    code, err = _run(tmp_path, capsys, src)
    assert code == 2 and "model.safetensors" in err, err
    _nothing_written(tmp_path)


def test_missing_shard(source_factory, tmp_path, capsys):
    src = source_factory("llama")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = _run(tmp_path, capsys, src)
    assert code == 2 and "missing" in err, err
    _nothing_written(tmp_path)


def test_missing_dir(tmp_path, capsys):
    code, err = _run(tmp_path, capsys, tmp_path / "nowhere")
    assert code == 2 and "no such directory" in err


def test_crash_midway_leaves_nothing(source_factory, tmp_path, capsys, monkeypatch):
    """A failure after some layers were written removes the temporary directory."""
    src = source_factory("llama")
    calls = {"n": 0}
    real = mla_transform.convert_attention

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated crash in layer 1")
        return real(*args, **kwargs)

    monkeypatch.setattr(mla_transform, "convert_attention", failing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(tmp_path, capsys, src)
    _nothing_written(tmp_path)


@pytest.mark.parametrize("engine, mla, needles", [
    ("vllm", {"kv_lora_rank": 32, "qk_rope_head_dim": 8},
     ["vllm serves kv_lora_rank + qk_rope_head_dim = 256 + 64 or 512 + 64 only", "this recipe gives 32 + 8",
      "256 + 64 (0.20x for this model, larger than its cache)"]),
    ("llama.cpp", {"kv_lora_rank": 32, "qk_rope_head_dim": 16}, ["cannot load qk_nope_head_dim 0"]),
])
def test_serve_with_refuses_a_shape_the_engine_does_not_serve(source_factory, tmp_path, capsys, engine, mla, needles):
    code, err = _run(tmp_path, capsys, source_factory("llama"), serve_with=engine, **mla)  # KV: 2 x 2 x 16 = 64
    assert code == 2 and all(n in err for n in needles), err
    _nothing_written(tmp_path)


def test_serve_with_passes_a_shape_the_engine_serves_and_every_report_says_who_serves_it(source_factory, tmp_path,
                                                                                         capsys):
    src = source_factory("llama", hidden_size=512, num_attention_heads=4, num_key_value_heads=4, head_dim=128,
                         intermediate_size=64)
    code, err = _run(tmp_path, capsys, src, kv_lora_rank=256, qk_rope_head_dim=64, serve_with="vllm")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert report["servable_by"] == {"vllm": ["TRITON_MLA", "FLASHINFER_MLA"], "sglang": ["flashinfer"],
                                     "llama.cpp": ["DEEPSEEK2"]}
    assert report["qk_nope_head_dim"] == 64


def test_calibration_text_on_a_source_without_a_tokenizer_is_one_line(source_factory, tmp_path, capsys):
    src = source_factory("llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (src / name).unlink(missing_ok=True)
    recipe = {"model": str(src), "output_dir": str(tmp_path / "out"), "dtype": "float32", "device": "cpu",
              "mla": {"kv_lora_rank": 32, "qk_rope_head_dim": 8},
              "init": {"preset": "best", "calibration": {"dataset": "pytext:calibration", "num_tokens": 512}}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code = main(["convert", str(path), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "has no tokenizer files" in err and "Traceback" not in err, err
    error = err[err.index("ecomla convert: error"):].strip().splitlines()
    assert len(error) == 2 and "init.calibration" in error[1], err  # "cannot convert:" and the one problem
    _nothing_written(tmp_path)
