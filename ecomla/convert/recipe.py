"""The `ecomla convert` recipe: what to convert, to which attention (MLA, GQA/MQA, LRKV), initialized how.

Every key is documented here and printed by `ecomla convert --help`. Checks
that need the source checkpoint (r_kv against the hidden size, d_r against
the head dim, KV groups against the query heads, the LRKV rank against the
head dim) run in `ecomla.convert.plan` and `ecomla.convert.targets` before
anything is computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ecomla.convert import presets
from ecomla.mla.rope import RopeDims
from ecomla.mla.rope_key import RopeAllocation, RopeKey, RopeResidual
from ecomla.recipe.schema import knob


@dataclass
class TextSource:
    """A text dataset used for calibration or evaluation."""

    dataset: str = knob(
        help="Local .jsonl/.json/.txt/.parquet file or directory (relative to the working directory), "
        "a hub dataset name when online, tinyworld:SPLIT[:DOMAIN] (the generated tiny-world corpus) or "
        "pytext:SPLIT[:DOMAIN] (the installed Python's prose and stdlib code; SPLIT calibration/train/heldout, "
        "DOMAIN prose/code)"
    )
    text_field: str = knob("text", help="Field holding the document text (.jsonl/.parquet)")
    split: str = knob("train", help="Split to read from a hub dataset")
    subset: str | None = knob(None, help="Configuration of a hub dataset (e.g. wikitext-2-raw-v1)")

    def texts(self):
        """The documents of this source, in order."""
        from ecomla.data.text import iter_texts

        return iter_texts(self.dataset, text_field=self.text_field, split=self.split, subset=self.subset)


@dataclass
class CalibrationConfig(TextSource):
    """Calibration tokens (for fitting) and held-out tokens (for the report) from one source."""

    num_tokens: int = knob(65536, help="Tokens used to fit the latent (rounded down to whole sequences)")
    seq_len: int = knob(256, help="Sequence length of calibration and held-out blocks")
    heldout_tokens: int = knob(
        16384, help="Tokens after the calibration ones, never fitted on: reconstruction error and perplexity"
    )
    heldout: TextSource | None = knob(
        None, help="A separate held-out source; null cuts held-out blocks from `dataset` after the calibration ones"
    )
    batch_size: int = knob(8, help="Sequences per forward pass while walking the source layer by layer")

    def check(self) -> list[str]:
        problems = []
        if self.seq_len < 2:
            problems.append("seq_len: must be at least 2")
        elif self.num_tokens < self.seq_len:
            problems.append(f"num_tokens: {self.num_tokens} is less than one sequence (seq_len={self.seq_len})")
        if self.heldout_tokens < 0:
            problems.append("heldout_tokens: must be >= 0")
        if self.batch_size < 1:
            problems.append("batch_size: must be >= 1")
        return problems


@dataclass
class MLAConfig:
    """Shape of the MLA attention written into the stock DeepSeek-V3 config."""

    kv_lora_rank: int | None = knob(
        None, help="r_kv, the latent width cached per token and layer; set this or target_compression"
    )
    target_compression: float | None = knob(
        None, help="KV compression ratio to reach (e.g. 10.67); r_kv is derived as round(2·n_kv·d_h/ratio − d_r)"
    )
    rank_allocation: Literal["uniform", "energy"] = knob(
        "uniform",
        help="uniform: r_kv in every layer. energy: the same total spread over layers by singular-value energy "
        "(stock DeepSeek-V3 has one kv_lora_rank, so narrower layers are zero-padded: the report gives both ratios)",
    )
    qk_rope_head_dim: int | None = knob(None, help="d_r, width of the shared RoPE key; null = half the source head dim")
    rope_dims: RopeDims = knob(
        "last",
        help="Which head dims keep RoPE: last (X-EcoMLA, fresh RoPE), high/low/uniform (MHA2MLA frequency subsets, "
        "original frequencies kept where stock RoPE can express them), norm (2-norm ranking; needs calibration)",
    )
    q_lora_rank: int | None = knob(
        None, help="null: full q_proj. An int: low-rank query q_a_proj -> q_a_layernorm -> q_b_proj, SVD-initialized"
    )
    rope_interleave: bool = knob(
        True, help="Lay RoPE dims out interleaved, as DeepSeek-V3 checkpoints and serving engines expect"
    )
    energy_multiple: int = knob(8, help="rank_allocation=energy: per-layer ranks are multiples of this")
    rope_key: RopeKey = knob(
        "mean",
        help="The shared RoPE key from the KV heads: mean (X-EcoMLA), rorope (per frequency pair, the head mixing "
        "that keeps the most key energy, from the weights), rorope_act (the same fitted to calibration key "
        "activations; needs init.calibration). All agree for a single-KV-head source",
    )
    rope_residual: RopeResidual = knob(
        "latent_mean",
        help="rope_key rorope/rorope_act: the RoPE key part the shared key does not carry (the other head mixtures "
        "of each kept pair). drop: leave it out. latent: keep it without its rotation, as d_r more no-RoPE key dims "
        "per head through the latent and kv_b_proj (exact at relative position 0, like partial RoPE's unkept pairs). "
        "latent_mean: the same dims, with the source's rotation of each pair averaged over the causal distances of "
        "rope_residual_context tokens (slow pairs kept, fast ones fade out). Both latent ones grow qk_nope_head_dim "
        "by d_r and cost no cache. mean (X-EcoMLA) and single-KV-head sources have no residual. latent_mean is the "
        "safe choice; latent hurts where the kept pairs turn fast (measurements: docs/convert.md)",
    )
    rope_residual_context: int | None = knob(
        None,
        help="rope_residual=latent_mean: the context T whose causal distances (weight T - distance) average each "
        "pair's rotation; null: init.calibration.seq_len when calibration is set, else the source's "
        "max_position_embeddings",
    )
    rope_residual_distances: Literal["causal", "attention"] = knob(
        "causal",
        help="rope_residual=latent_mean: which relative distances average each pair's rotation. causal: every causal "
        "pair of a rope_residual_context-token window alike. attention: per query head, the distances its source "
        "attention actually reads on the calibration text (most mass near the diagonal and on the first token), so "
        "the fast pairs a head uses locally keep their turn (needs init.calibration)",
    )
    latent_norm: Literal["normalize", "linear"] = knob(
        "normalize",
        help="How the latent meets stock DeepSeek-V3's kv_a_layernorm. normalize: the latent is an orthonormal "
        "projection of the attention input and the norm rescales it per token, exact only at full width. linear: the "
        "latent is scaled down until its mean square stays below 1/1000 of the norm's epsilon, where RMSNorm is a "
        "fixed scale to within 0.05%, so the per-token rescaling disappears at every width. The output then sets "
        "rms_norm_eps to the 1e-6 transformers hard-codes for kv_a_layernorm, so engines that read the epsilon from "
        "the config (llama.cpp, vLLM) scale the latent the same way (docs/convert.md#the-latent-norm). config.json "
        "records the layout (ecomla_linear_latent), so every later checkpoint carries it. A linear student trains "
        "under train.mode full or stages, which train each scaled tensor at its natural size; train.mode lora "
        "refuses it (docs/distill.md)",
    )
    serve_with: Literal["any", "vllm", "sglang", "llama.cpp"] = knob(
        "any", help="Refuse, before any compute, a shape this engine is not known to serve, naming the nearest "
        "shapes it does and their compression for this model: vllm and sglang take kv_lora_rank + "
        "qk_rope_head_dim = 256 + 64 or 512 + 64 only; llama.cpp needs qk_nope_head_dim >= 1. Every conversion "
        "reports `servable_by` whatever this says (docs/serving.md#which-shapes-the-engines-serve)",
    )
    rope_allocation: RopeAllocation = knob(
        "fixed",
        help="fixed: rope_dims picks d_r/2 frequency pairs, each keeping its strongest head mixture. energy: the d_r/2 "
        "slots go to the largest per-pair mixture energies over all pairs (a strong pair may keep two). Stock "
        "DeepSeek-V3 RoPE has one geometric list of distinct frequencies, so energy is written only when it keeps one "
        "mixture of each pair of such a run, the same in every layer; otherwise the conversion stops with the reason. "
        "Every rorope/rorope_act report gives, per layer, the key energy both allocations keep rotated",
    )

    def check(self) -> list[str]:
        problems = []
        if (self.kv_lora_rank is None) == (self.target_compression is None):
            problems.append("kv_lora_rank: set exactly one of mla.kv_lora_rank and mla.target_compression")
        if self.kv_lora_rank is not None and self.kv_lora_rank < 1:
            problems.append("kv_lora_rank: must be >= 1")
        if self.target_compression is not None and self.target_compression <= 1:
            problems.append("target_compression: must be > 1 (it is a compression ratio)")
        if self.qk_rope_head_dim is not None and (self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2):
            problems.append(f"qk_rope_head_dim: must be even and >= 2 (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            problems.append("q_lora_rank: must be >= 1 or null")
        if self.energy_multiple < 1:
            problems.append("energy_multiple: must be >= 1")
        if self.rope_residual_context is not None and self.rope_residual_context < 1:
            problems.append(f"rope_residual_context: must be >= 1 or null, got {self.rope_residual_context}")
        if self.rope_allocation == "energy":
            if self.rope_key == "mean":
                problems.append("rope_allocation: energy allocates the RoRoPE head mixtures; set mla.rope_key to "
                                "rorope or rorope_act")
            if self.rope_dims != "last":
                problems.append(f"rope_dims: not read under mla.rope_allocation=energy, which picks the RoPE pairs "
                                f"itself; remove rope_dims: {self.rope_dims}")
        return problems


@dataclass
class InitConfig:
    """How the latent projections are initialized."""

    method: Literal["svd", "activation", "random"] = knob(
        "svd",
        help="svd: X-EcoMLA joint SVD of the no-RoPE key and value rows (no data). activation: fit the latent to "
        "real key/value activations of the calibration tokens. random: stock initializer (baseline)",
    )
    calibration: CalibrationConfig | None = knob(
        None, help="Calibration data; needed by method=activation and rope_dims=norm, optional otherwise (adds "
        "held-out reconstruction error and perplexity to the report)"
    )
    ridge: float = knob(1e-6, help="method=activation: ridge on the up-projection fit, relative to the mean eigenvalue")
    kv_balance: bool = knob(
        False,
        help="Fit the latent's basis with the key rows scaled to the value rows' total energy (TransMLA's balanced "
        "K/V PCA; energy under the calibration inputs for method=activation, the weights' norm for svd); the "
        "up-projection still reproduces the unscaled keys and values",
    )
    objective: Literal["kv", "attention"] = knob(
        "kv",
        help="What the latent's basis keeps. kv: the key and value rows themselves (every method so far). attention: "
        "what the layer's output sees of them: key rows weighted by the second moment of the query rows that read "
        "them (score error), value rows by o_proj (output error), keys scaled by key_weight times the head's value "
        "output energy (a score error moves the output by about that much). The up-projection still reproduces the "
        "unweighted rows",
    )
    key_weight: float = knob(
        1.0, help="objective=attention: weight of score errors against output errors; 1 weighs them as the "
        "layer's output feels them (how it was chosen: docs/convert.md#the-levers-of-best)"
    )
    token_weights: Literal["uniform", "attention"] = knob(
        "uniform",
        help="How much each calibration token counts in the fits of the K/V latent and, with rope_key rorope_act, the "
        "RoPE key (method=activation; the query latent stays uniform). uniform: alike. attention: by the source "
        "attention mass it receives in its block, averaged over the query heads (mean 1), since a key's or value's "
        "error reaches the output through that attention: the heads' sink (a block's first token) counts for every "
        "query that reads it. Measured on SmolLM2: docs/convert.md#calibration-tokens-weighed-by-the-attention-they-receive-inittoken_weights",
    )
    token_weight_power: float = knob(
        1.0, help="token_weights=attention: each token's weight is its received attention mass to this power (1: the "
        "mass itself; 0.5 tempers the sink's share; 0 is uniform)",
    )
    query_moment: Literal["weighted", "uniform"] = knob(
        "weighted",
        help="token_weights=attention with objective=attention: the second moment of the queries in the key rows' "
        "weight (the score error s·q·δk). weighted: the key tokens' attention-weighted one, so queries count by the "
        "attention their own tokens receive. uniform: every query alike, as the layer's output counts them",
    )
    refit: Literal["none", "values"] = knob(
        "none",
        help="After each layer's fit, values: refit the value rows of kv_b_proj and o_proj by least squares so the "
        "converted layer, reading the converted model's own calibration states through its own attention, "
        "reproduces the source layer's attention output plus the drift the earlier converted layers left in the "
        "residual stream. Closed form, one more pass over the calibration tokens per layer (needs init.calibration)",
    )
    refit_ridge: float = knob(
        1e-2, help="refit=values: ridge on the least squares, relative to the mean eigenvalue of the features' Gram "
        "matrix, pulling the refit toward the latent fit's own value path (so a path that is already exact stays)"
    )
    preset: presets.PresetName | None = knob(
        "auto",
        help="A named recipe that fills the mla/init keys this recipe leaves unset (set keys win; the report's "
        "`preset` records the expansion and the overrides). " + presets.describe() + ". auto (the default): "
        "best when init.calibration is given, nodata when not, for a recipe that sets none of these keys; one "
        "that sets any of them gets the rest from the base defaults, as does null (X-EcoMLA's svd/last/mean "
        "with the normalized latent). Shapes and calibration stay the recipe's; how each peer is approximated "
        "in stock DeepSeek-V3: docs/convert.md#presets",
    )


@dataclass
class GQAConfig:
    """target gqa: how many key/value heads the output keeps."""

    num_key_value_heads: int = knob(
        help="KV heads g of the output; must divide the source's query heads. Query head h reads KV head "
        "h // (n_h/g); each KV head is the mean of the source K/V heads its query heads read (exact when g is a "
        "multiple of the source's KV heads)"
    )

    def check(self) -> list[str]:
        if self.num_key_value_heads < 1:
            return [f"num_key_value_heads: must be >= 1, got {self.num_key_value_heads}"]
        return []


@dataclass
class LRKVTargetConfig:
    """target lrkv: the residual rank of the LRKV model written (its model config is ecomla.lrkv.LrkvConfig)."""

    rank: int = knob(
        help="r, the rank of each query head's K and V residual around the shared mean head; "
        "1..min(hidden, head_dim), exact at min(hidden, head_dim). The cache holds 2·(d_h + n_h·r) numbers per "
        "token and layer"
    )

    def check(self) -> list[str]:
        if self.rank < 1:
            return [f"rank: must be >= 1, got {self.rank}"]
        return []


@dataclass
class ConvertRecipe:
    """`ecomla convert`: a Llama/Mistral/Qwen2 checkpoint to stock DeepSeek-V3 MLA, fewer KV heads or LRKV."""

    model: str = knob(help="Source checkpoint: a local directory, or a hub name when online")
    output_dir: str = knob(help="Where the converted checkpoint is written (must not exist unless --force)")
    target: Literal["mla", "gqa", "mqa", "lrkv"] = knob(
        "mla",
        help="Attention of the output. mla: stock DeepseekV3ForCausalLM (reads mla, init). gqa: the source's own "
        "class with gqa.num_key_value_heads KV heads, mean-pooled. mqa: gqa with one KV head. lrkv: "
        "LrkvForCausalLM, each head's K/V = shared mean head + rank lrkv.rank SVD residual. gqa/mqa/lrkv need no "
        "data, keep every other weight unchanged, and refuse mla/init sections that differ from the defaults",
    )
    mla: MLAConfig = knob(default_factory=MLAConfig, help="MLA shape (target mla only)")
    init: InitConfig = knob(
        default_factory=InitConfig, help="Initialization of the latent projections (target mla only)"
    )
    gqa: GQAConfig | None = knob(None, help="Target gqa only: the KV heads to keep (required there)")
    lrkv: LRKVTargetConfig | None = knob(None, help="Target lrkv only: the residual rank (required there)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = knob(
        "auto", help="Output weight dtype; auto keeps the source's"
    )
    device: str = knob("auto", help="Where to compute: auto (cuda if available), cpu, cuda, cuda:1, ...")
    seed: int = knob(0, help="Seed for method=random")

    @staticmethod
    def expand_raw(data: dict) -> dict:
        """init.preset's keys, filled in before validation (`ecomla.convert.presets`)."""
        return presets.expand(data)

    def check(self) -> list[str]:
        problems = self._target_problems()
        if self.target != "mla":
            return problems  # mla/init are not read; _target_problems refused them if they were changed
        needs = []
        if self.init.method == "activation":
            needs.append("init.method=activation")
        if self.mla.rope_dims == "norm":
            needs.append("mla.rope_dims=norm")
        if self.mla.rope_key == "rorope_act":
            needs.append("mla.rope_key=rorope_act")
        if self.mla.rope_residual_distances == "attention":
            needs.append("mla.rope_residual_distances=attention")
        if self.init.refit != "none":
            needs.append(f"init.refit={self.init.refit}")
        problems += self._init_problems()
        if needs and self.init.calibration is None:
            chosen = presets.resolved(self.init.preset, self.init)
            via = f" (init.preset {chosen})" if chosen else ""
            problems.append(f"init.calibration: {' and '.join(needs)}{via} need calibration data; set "
                            f"init.calibration.dataset")
        return problems

    def _init_problems(self) -> list[str]:
        """Keys that only some methods or layouts read, refused where they would be ignored."""
        init, mla, problems = self.init, self.mla, []
        if init.key_weight <= 0:
            problems.append(f"init.key_weight: must be > 0, got {init.key_weight}")
        if init.refit_ridge < 0:
            problems.append(f"init.refit_ridge: must be >= 0, got {init.refit_ridge}")
        if init.method == "random":
            for key, value, default in (("init.objective", init.objective, "kv"), ("init.refit", init.refit, "none"),
                                        ("mla.latent_norm", mla.latent_norm, "normalize")):
                if value != default:
                    problems.append(f"{key}: {value} fits the latent, but init.method random draws it; use "
                                    f"init.method activation or svd, or remove {key}")
        if init.token_weight_power < 0:
            problems.append(f"init.token_weight_power: must be >= 0, got {init.token_weight_power}")
        if init.token_weight_power != 1.0 and init.token_weights == "uniform":
            problems.append("init.token_weight_power: only token_weights attention reads it; set init.token_weights: "
                            "attention, or remove init.token_weight_power")
        if init.token_weights != "uniform" and init.method != "activation":
            problems.append(f"init.token_weights: {init.token_weights} weighs the calibration tokens of the activation "
                            f"fit, but init.method is {init.method}; use init.method activation, or remove "
                            "init.token_weights")
        if init.query_moment != "weighted" and (init.token_weights == "uniform" or init.objective != "attention"):
            problems.append("init.query_moment: only token_weights attention with objective attention reads it (the "
                            "queries are weighed as the keys are); set both, or remove init.query_moment")
        if init.objective == "attention" and init.kv_balance:
            problems.append("init.kv_balance: objective attention weighs keys against values itself; remove "
                            "init.kv_balance (or use objective kv)")
        if mla.rope_residual_distances == "attention" and (mla.rope_residual != "latent_mean" or mla.rope_key == "mean"):
            problems.append("mla.rope_residual_distances: attention weighs the rotation that rope_residual=latent_mean "
                            "averages, which only rorope/rorope_act keys have; set mla.rope_residual: latent_mean and "
                            "mla.rope_key: rorope_act, or remove rope_residual_distances")
        return problems

    def _target_problems(self) -> list[str]:
        """Each section belongs to one target: required there, refused elsewhere.

        `mla` and `init` always exist (they have defaults), so for the other targets a section counts
        as set when it differs from its defaults; one set to exactly the defaults is ignored.
        """
        problems = []
        for section, key in (("gqa", "num_key_value_heads"), ("lrkv", "rank")):  # each read by its own target
            given = getattr(self, section) is not None
            if self.target == section and not given:
                problems.append(f"{section}: target {section} needs this section; set {section}.{key}")
            elif given and self.target != section:
                hint = "; mqa always keeps one KV head" if self.target == "mqa" and section == "gqa" else ""
                problems.append(f"{section}: only target {section} reads this section, but target is "
                                f"{self.target}; remove it{hint}")
        if self.target != "mla":
            if self.mla != MLAConfig():
                problems.append(f"mla: only target mla reads this section, but target is {self.target}; remove it")
            if self.init != InitConfig():
                problems.append(f"init: only target mla reads this section, but target is {self.target}; remove it")
        return problems


def preset_recipe(model: str, output_dir: str, preset: str, kv_lora_rank: int, qk_rope_head_dim: int, *,
                  calibration_tokens: int, seq_len: int, overrides: dict[str, dict] | None = None) -> ConvertRecipe:
    """The convert recipe the benchmarks use for `preset` at r_kv + d_r: fp32 on CPU, calibrated on
    `calibration_tokens` of `pytext:calibration` (no held-out split), with `overrides` (section -> key -> value)
    set over the preset's keys."""
    from ecomla.recipe.schema import load_recipe

    overrides = overrides or {}
    data = {"model": model, "output_dir": output_dir, "dtype": "float32", "device": "cpu",
            "mla": {"kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": qk_rope_head_dim, **overrides.get("mla", {})},
            "init": {"preset": preset, "calibration": {"dataset": "pytext:calibration", "num_tokens": calibration_tokens,
                                                       "seq_len": seq_len, "heldout_tokens": 0},
                     **overrides.get("init", {})}}
    return load_recipe(ConvertRecipe, data=data)
