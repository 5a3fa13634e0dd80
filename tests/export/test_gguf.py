"""`ecomla export gguf`: ecomla checkpoints and their source Llamas through llama.cpp's converter and engine.

Proves: what llama.cpp reads differently in a dense DeepSeek-V3 config is fixed in the converter's input only,
and a MoE config, a missing config, a wrong suffix and an output in the way are refused; a tiny random Llama
(with SmolLM2's real tokenizer, which llama.cpp knows) and its MLA conversion both export, load in llama.cpp,
give transformers' logits (with f32 cache cells), and cache exactly the bytes per token that their formulas say: 2 * n_kv * d_h per
layer for the Llama, r_kv + d_r per layer for MLA (2 bytes each in llama.cpp's default f16 cells, 4 in f32).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ecomla.export.gguf import ExportError, converter_config, export_gguf
from tests.convert.helpers import convert, load
from tests.tiny import make_source

DENSE = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 2,
         "first_k_dense_replace": 2, "q_lora_rank": None, "qk_nope_head_dim": 16,
         "n_routed_experts": 1, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 1}


def test_converter_input_fixes_only_what_llama_cpp_reads_differently():
    cfg, notes = converter_config(DENSE)
    assert cfg["q_lora_rank"] == 0 and cfg["n_routed_experts"] == 2 and cfg["n_group"] == 1 and len(notes) == 2
    assert DENSE["q_lora_rank"] is None  # the checkpoint's own config is not touched
    cfg, notes = converter_config({**DENSE, "q_lora_rank": 32, "n_routed_experts": 4})
    assert cfg["q_lora_rank"] == 32 and cfg["n_routed_experts"] == 4 and notes == []
    llama = {"model_type": "llama", "num_hidden_layers": 2, "architectures": ["LlamaForCausalLM"]}
    assert converter_config(llama) == (llama, [])
    cfg, notes = converter_config({"model_type": "llama", "num_hidden_layers": 2})  # as read from a GGUF
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "from model_type" in notes[0]
    with pytest.raises(ExportError, match="MoE layers"):
        converter_config({**DENSE, "first_k_dense_replace": 1})
    with pytest.raises(ExportError, match="asserts qk_nope_head_dim >= 1"):
        converter_config({**DENSE, "qk_nope_head_dim": 0})


def test_a_shape_llama_cpp_would_abort_on_is_refused_and_nothing_is_written(source_factory, tmp_path):
    """qk_nope_head_dim 0 (d_r = d_h, no residual): llama.cpp's loader asserts and kills the process, so the export
    stops before the converter runs, with the cause and the fix, and leaves no file."""
    src = source_factory("llama")
    mla = tmp_path / "mla"
    convert(src, mla, mla={"kv_lora_rank": 32, "qk_rope_head_dim": 16})  # head dim 16
    assert json.loads((mla / "config.json").read_text())["qk_nope_head_dim"] == 0
    with pytest.raises(ExportError, match="qk_rope_head_dim below the head dim"):
        export_gguf(mla, tmp_path / "x.gguf", converter=tmp_path)  # refused before the converter is even looked for
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["mla", src.name])


def test_export_refuses_bad_input(tmp_path):
    with pytest.raises(ExportError, match="no config.json"):
        export_gguf(tmp_path, tmp_path / "x.gguf")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ExportError, match="must be a .gguf file"):
        export_gguf(tmp_path, tmp_path / "x.bin")
    (tmp_path / "x.gguf").write_text("")
    with pytest.raises(ExportError, match="already exists; pass --force"):
        export_gguf(tmp_path, tmp_path / "x.gguf")
    with pytest.raises(ExportError, match="has no convert_hf_to_gguf.py"):
        export_gguf(tmp_path, tmp_path / "y.gguf", converter=tmp_path)
    assert not list(tmp_path.glob(".*partial"))


@pytest.fixture(scope="module")
def smol_tokenizer(tmp_path_factory):
    from ecomla.fetch import save_tokenizer

    return save_tokenizer("smollm2-135m-instruct", tmp_path_factory.mktemp("smol_tok"))


def _hf_logits(path, ids):
    with torch.no_grad():
        return load(path)(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.slow
def test_a_tiny_llama_and_its_mla_conversion_run_in_llama_cpp(tmp_path, smol_tokenizer):
    from ecomla.export import engine

    # head_dim 32: llama.cpp's CPU kernels want head sizes it has; rms_norm_eps 1e-6 as transformers'
    # kv_a_layernorm, so that the one known difference (llama.cpp's norm ε for the latent) is not in play.
    source = make_source(tmp_path / "llama", smol_tokenizer, hidden_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6)
    mla = tmp_path / "mla"
    convert(source, mla, mla={"kv_lora_rank": 48, "qk_rope_head_dim": 16, "rope_dims": "high"})
    cfg = json.loads((mla / "config.json").read_text())
    layers, n_kv, d_h = 2, 2, 32
    ids = [int(i) for i in torch.randint(100, 40000, (48,), generator=torch.Generator().manual_seed(0))]
    for name, path, cached in (("llama", source, 2 * n_kv * d_h), ("mla", mla, 48 + 16)):
        gguf = export_gguf(path, tmp_path / f"{name}.gguf", outtype="f32", quiet=True)
        exact = engine.load(gguf, n_ctx=128, cache="f32")
        ours, theirs = engine.logits(exact, ids), _hf_logits(path, ids)
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=0, err_msg=name)
        # as served: llama.cpp's default f16 cells, 2 bytes per cached number, per token and layer
        served = engine.load(gguf, n_ctx=128)
        assert engine.kv_bytes_per_token(served, ids, 16, 48) == cached * layers * 2, name
        assert engine.kv_bytes_per_token(exact, ids, 16, 48) == cached * layers * 4, name
    assert cfg["q_lora_rank"] is None  # the exported checkpoint itself is unchanged


@pytest.mark.slow
def test_a_linear_latent_runs_in_llama_cpp_because_it_reads_the_configs_epsilon(tmp_path, smol_tokenizer):
    """mla.latent_norm=linear scales the latent by kv_a_layernorm's ε, so the ε every engine uses must be the one
    transformers hard-codes (1e-6): ecomla writes it into rms_norm_eps, which llama.cpp reads for that norm. A source
    with ε 1e-5 converted that way gives transformers' logits in llama.cpp, f32 exactly and f16 as closely as the
    plain latent does; with the config's ε put back to 1e-5 llama.cpp's latent is √10 off and the logits move."""
    from ecomla.export import engine

    source = make_source(tmp_path / "llama", smol_tokenizer, hidden_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5)
    ids = [int(i) for i in torch.randint(100, 40000, (48,), generator=torch.Generator().manual_seed(0))]
    errors = {}
    for norm in ("normalize", "linear"):
        mla = tmp_path / norm
        convert(source, mla, mla={"kv_lora_rank": 48, "qk_rope_head_dim": 16, "rope_dims": "high", "latent_norm": norm})
        theirs = _hf_logits(mla, ids)
        for outtype in ("f32", "f16"):
            gguf = export_gguf(mla, tmp_path / f"{norm}-{outtype}.gguf", outtype=outtype, quiet=True)
            ours = engine.logits(engine.load(gguf, n_ctx=128, cache="f32"), ids)
            errors[norm, outtype] = float(np.abs(ours - theirs).max())
    assert errors["linear", "f32"] < 2e-4, errors
    assert errors["linear", "f16"] < 2 * errors["normalize", "f16"], errors
    cfg = json.loads((tmp_path / "linear" / "config.json").read_text())
    assert cfg["rms_norm_eps"] == 1e-6
    (tmp_path / "linear" / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    gguf = export_gguf(tmp_path / "linear", tmp_path / "eps.gguf", outtype="f32", quiet=True)
    moved = float(np.abs(engine.logits(engine.load(gguf, n_ctx=128, cache="f32"), ids) - theirs).max())
    assert moved > 1.0, moved


def test_cli_export_gguf_help_and_errors(tmp_path, capsys):
    from ecomla.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["export", "gguf", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--outtype" in out and "q8_0" in out and "llama-cpp-python sdist" in out
    assert main(["export", "gguf", str(tmp_path), str(tmp_path / "m.gguf")]) == 2
    assert "no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "gguf", str(tmp_path), str(tmp_path / "m.gguf"), "--outtype", "q4"])
    assert "invalid choice: 'q4'" in capsys.readouterr().err


@pytest.mark.slow
def test_a_distilled_linear_latent_exports_with_its_scale(tmp_path, smol_tokenizer):
    """The layout rides in config.json through a distillation: the distilled final/ (trained at natural scale, no
    conversion report beside it) keeps rms_norm_eps 1e-6 and its layout key, and llama.cpp gives its logits."""
    from ecomla.convert import layout
    from ecomla.export import engine
    from tests.distill import world as w

    source = make_source(tmp_path / "llama", smol_tokenizer, hidden_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5)
    student = tmp_path / "linear"
    convert(source, student, mla={"kv_lora_rank": 48, "qk_rope_head_dim": 16, "rope_dims": "high", "latent_norm": "linear"})
    text = tmp_path / "text.jsonl"
    gen = torch.Generator().manual_seed(1)
    text.write_text("".join(json.dumps({"text": " ".join(f"w{int(i)}" for i in torch.randint(0, 500, (200,), generator=gen))})
                            + "\n" for _ in range(8)))
    recipe = {"student": str(student), "teacher": {"model": str(source)},
              "data": {"train": {"dataset": str(text)}, "seq_len": 64},
              "train": {"total_tokens": 256 * 3, "global_batch_tokens": 256, "micro_batch_size": 2, "lr": 3e-3,
                        "warmup_ratio": 0.0, "precision": "fp32"},
              "deepspeed": {"zero_stage": 0}, "checkpoint": {"every_steps": 0}, "log": {"tensorboard": False},
              "output_dir": str(tmp_path / "run")}
    proc = w.run(w.write_recipe(tmp_path / "r.yaml", recipe))
    assert proc.returncode == 0, w.errors(proc)
    final = tmp_path / "run" / "final"
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["rms_norm_eps"] == 1e-6 and layout.CONFIG_KEY in cfg
    ids = [int(i) for i in torch.randint(100, 40000, (48,), generator=torch.Generator().manual_seed(0))]
    theirs = _hf_logits(final, ids)
    assert np.abs(theirs - _hf_logits(student, ids)).max() > 1e-3  # it trained
    gguf = export_gguf(final, tmp_path / "final.gguf", outtype="f32", quiet=True)
    ours = engine.logits(engine.load(gguf, n_ctx=128, cache="f32"), ids)
    assert float(np.abs(ours - theirs).max()) < 2e-4


def test_llama_cpp_serving_settings_flash_attention_quantized_latent_and_decode_rates(tmp_path, smol_tokenizer):
    """What scripts/bench_llama_cpp.py measures, on a tiny MLA export: flash attention gives the same logits;
    a latent whose cached row (64 + 32) and latent (64) are whole 32-number blocks loads as q8_0 and q4_0 cells, at
    34 and 18 bytes per block, with logits that move more the fewer bits; quantized cells without flash attention
    are refused by us with the fix, and a latent of 48 by llama.cpp even in a whole 64-number row (48 + 16); decode
    rates come per context and repetition."""
    from ecomla.export import engine

    source = make_source(tmp_path / "llama", smol_tokenizer, hidden_size=128, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-6)
    ids = [int(i) for i in torch.randint(100, 40000, (64,), generator=torch.Generator().manual_seed(0))]
    ggufs = {}
    for rank, d_r in ((64, 32), (48, 16)):
        convert(source, tmp_path / f"mla{rank}", mla={"kv_lora_rank": rank, "qk_rope_head_dim": d_r, "rope_dims": "high"})
        ggufs[rank] = export_gguf(tmp_path / f"mla{rank}", tmp_path / f"mla{rank}.gguf", outtype="f32", quiet=True)
    plain = engine.logits(engine.load(ggufs[64], n_ctx=128), ids)
    moved, per_token = {}, {}
    for cache in ("f16", "q8_0", "q4_0"):
        llm = engine.load(ggufs[64], n_ctx=128, cache=cache, flash_attn=True)
        moved[cache] = float(np.abs(engine.logits(llm, ids) - plain).max())
        per_token[cache] = engine.kv_bytes_per_token(llm, ids, 16, 48)
    assert moved["f16"] < 1e-2 < moved["q4_0"] and moved["q8_0"] < moved["q4_0"], moved
    layers, row = 2, 64 + 32
    assert per_token == {"f16": row * layers * 2, "q8_0": row // 32 * 34 * layers, "q4_0": row // 32 * 18 * layers}
    with pytest.raises(ValueError, match="only with flash attention; pass flash_attn=True"):
        engine.load(ggufs[64], n_ctx=128, cache="q8_0")
    with pytest.raises(ValueError, match="is not one of"):
        engine.load(ggufs[64], n_ctx=128, cache="q5")
    with pytest.raises(ValueError):  # the row (64) is whole q8_0 blocks, the latent (48) is not: llama.cpp refuses
        engine.load(ggufs[48], n_ctx=128, cache="q8_0", flash_attn=True)
    llm = engine.load(ggufs[64], n_ctx=128, logits_all=False, flash_attn=True)
    rates = engine.decode_rates(llm, ids, [48, 16], steps=3, reps=2)
    assert list(rates) == [16, 48] and all(len(r) == 2 and min(r) > 0 for r in rates.values())
    assert llm.n_tokens == 48 + 3
    with pytest.raises(ValueError, match="contexts: 100 tokens asked"):
        engine.decode_rates(llm, ids, [100], steps=1, reps=1)
