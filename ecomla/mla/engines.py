"""Which serving engines, and which of their attention backends, run an MLA shape.

Facts only: no transformers, no files. They come from the engines' trackers and code as of FACTS_DATE
(docs/serving.md#which-shapes-the-engines-serve lists each with its source) and change with every release, so
`servable_by` says "known to serve", never "cannot serve" for a backend it does not list.

A shape is (kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim): the cached latent and shared RoPE key per token
and layer, and the per-head no-RoPE query/key width the absorbed attention multiplies through.

    vLLM        its MLA layer takes kv_lora_rank + qk_rope_head_dim = 256 + 64 or 512 + 64 only. TRITON_MLA is
                the general path inside that (it crashed at 256 until a 2026 fix); FLASHMLA (SM90/SM100) and
                CUTLASS_MLA need 512 + 64; FLASHINFER_MLA needs qk_nope_head_dim 64, 128 or 192.
    SGLang      flashinfer MLA: 256 + 64 or 512 + 64 (FlashInfer 0.6.6); fa3: 512 + 64; trtllm_mla: 512 + 64 and
                qk_nope_head_dim 128.
    llama.cpp   DEEPSEEK2 runs any width, but its graph asserts qk_nope_head_dim >= 1 and aborts the process
                while loading a model without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FACTS_DATE = "2026-12"
Engine = Literal["vllm", "sglang", "llama.cpp"]
ENGINES: tuple[str, ...] = ("vllm", "sglang", "llama.cpp")


@dataclass(frozen=True)
class Backend:
    """One attention backend of an engine and the MLA shapes it is known to accept."""

    engine: str
    name: str
    latent: tuple[tuple[int, int], ...] | None = None  # accepted (kv_lora_rank, qk_rope_head_dim); None: any
    qk_nope: tuple[int, ...] | None = None  # accepted qk_nope_head_dim; None: any
    min_qk_nope: int = 0
    note: str = ""

    def accepts(self, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int) -> bool:
        return ((self.latent is None or (kv_lora_rank, qk_rope_head_dim) in self.latent)
                and (self.qk_nope is None or qk_nope_head_dim in self.qk_nope)
                and qk_nope_head_dim >= self.min_qk_nope)


VLLM_LATENT = ((256, 64), (512, 64))
BACKENDS: tuple[Backend, ...] = (
    Backend("vllm", "TRITON_MLA", VLLM_LATENT, note="the general path; kv_lora_rank 256 needs a 2026 release"),
    Backend("vllm", "FLASHINFER_MLA", VLLM_LATENT, qk_nope=(64, 128, 192)),
    Backend("vllm", "FLASHMLA", ((512, 64),), note="SM90/SM100 only"),
    Backend("vllm", "CUTLASS_MLA", ((512, 64),)),
    Backend("sglang", "flashinfer", VLLM_LATENT),
    Backend("sglang", "fa3", ((512, 64),)),
    Backend("sglang", "trtllm_mla", ((512, 64),), qk_nope=(128,)),
    Backend("llama.cpp", "DEEPSEEK2", min_qk_nope=1),
)


def servable_by(kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int) -> dict[str, list[str]]:
    """Engine -> the backends known to run this shape (engines with none are left out)."""
    out: dict[str, list[str]] = {}
    for b in BACKENDS:
        if b.accepts(kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim):
            out.setdefault(b.engine, []).append(b.name)
    return out


def accepted_latents(engine: str) -> tuple[tuple[int, int], ...] | None:
    """The (kv_lora_rank, qk_rope_head_dim) pairs any backend of `engine` takes; None: any width."""
    pairs: set[tuple[int, int]] = set()
    for b in BACKENDS:
        if b.engine == engine:
            if b.latent is None:
                return None
            pairs.update(b.latent)
    return tuple(sorted(pairs))


def refusal(engine: str, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int,
            kv_elements: int) -> str | None:
    """Why `engine` will not serve this shape, with the nearest shapes it does and their compression for a source
    that caches `kv_elements` numbers per token and layer; None when some backend of it serves the shape."""
    if engine == "any" or engine in servable_by(kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim):
        return None
    latents = accepted_latents(engine)
    if latents is None:  # llama.cpp: any width, but not without a no-RoPE key part
        return (f"{engine} cannot load qk_nope_head_dim {qk_nope_head_dim}: its DEEPSEEK2 graph asserts "
                "qk_nope_head_dim >= 1 and the process aborts while loading; keep some no-RoPE key dims "
                "(mla.qk_rope_head_dim below the head dim, or, for a source with several KV heads, mla.rope_key "
                "rorope/rorope_act, whose residual adds d_r of them)")
    have = f"{kv_lora_rank} + {qk_rope_head_dim}"
    options = ", ".join(f"{r} + {d} ({kv_elements / (r + d):.2f}x for this model"
                        f"{', larger than its cache' if r + d > kv_elements else ''})" for r, d in latents)
    return (f"{engine} serves kv_lora_rank + qk_rope_head_dim = {' or '.join(f'{r} + {d}' for r, d in latents)} "
            f"only (as of {FACTS_DATE}); this recipe gives {have}. Nearest shapes it serves: {options}")
