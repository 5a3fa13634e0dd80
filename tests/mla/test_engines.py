"""Which engines serve which MLA shapes (ecomla/mla/engines.py), and the refusal that names the shapes they do."""

from __future__ import annotations

from ecomla.mla import engines


def test_deepseek_v3s_own_shape_is_served_by_every_backend():
    served = engines.servable_by(512, 64, 128)
    assert served == {"vllm": ["TRITON_MLA", "FLASHINFER_MLA", "FLASHMLA", "CUTLASS_MLA"],
                      "sglang": ["flashinfer", "fa3", "trtllm_mla"], "llama.cpp": ["DEEPSEEK2"]}


def test_narrower_shapes_lose_backends_one_by_one():
    assert engines.servable_by(256, 64, 64) == {"vllm": ["TRITON_MLA", "FLASHINFER_MLA"], "sglang": ["flashinfer"],
                                                "llama.cpp": ["DEEPSEEK2"]}
    assert engines.servable_by(512, 64, 96) == {"vllm": ["TRITON_MLA", "FLASHMLA", "CUTLASS_MLA"],
                                                "sglang": ["flashinfer", "fa3"], "llama.cpp": ["DEEPSEEK2"]}
    assert engines.servable_by(64, 32, 32) == {"llama.cpp": ["DEEPSEEK2"]}  # every SmolLM2 student
    assert engines.servable_by(128, 64, 0) == {}  # SmolLM2 at 128 + 64 with d_r = d_h: nothing loads it


def test_the_refusal_names_the_shapes_the_engine_serves_and_their_ratios():
    why = engines.refusal("vllm", 128, 64, 64, kv_elements=2048)  # Llama-3.1-8B: 2 x 8 KV heads x 128
    assert "256 + 64 or 512 + 64" in why and "128 + 64" in why
    assert "256 + 64 (6.40x for this model)" in why and "512 + 64 (3.56x for this model)" in why
    small = engines.refusal("sglang", 128, 64, 64, kv_elements=384)  # SmolLM2
    assert "256 + 64 (1.20x for this model)" in small and "512 + 64 (0.67x for this model, larger than its cache)" in small
    assert "qk_nope_head_dim >= 1" in engines.refusal("llama.cpp", 128, 64, 0, kv_elements=384)
    assert engines.refusal("llama.cpp", 64, 32, 32, kv_elements=384) is None
    assert engines.refusal("any", 1, 2, 0, kv_elements=384) is None
    assert engines.refusal("vllm", 256, 64, 192, kv_elements=384) is None
