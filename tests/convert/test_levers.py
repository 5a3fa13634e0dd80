"""The conversion levers of `init.preset: best`, each against the same recipe without it, end to end.

Measured on the tiny world's trained base (`zoo/base`: 4 layers, 2 KV heads of 64), whose attention is
a real, peaked attention (random tiny models attend almost uniformly, where these levers have nothing to
act on): held-out KL(source‖converted) on tiny-world text falls with each lever. Plus the exact and
structural facts each lever rests on, on tiny random models.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ecomla.mla import latent
from tests.convert.helpers import convert, load, logit_error

ROOT = Path(__file__).resolve().parents[2]
ZOO_BASE = ROOT / "zoo" / "base"
CALIBRATION = {"dataset": "tinyworld:calibration", "heldout": {"dataset": "tinyworld:heldout"},
               "num_tokens": 8192, "heldout_tokens": 4096, "seq_len": 256}
# The recipe before the levers: the best one-shot recipe the real model's table found (activation + RoRoPE).
BEFORE_MLA = {"kv_lora_rank": 32, "qk_rope_head_dim": 16, "rope_dims": "high", "rope_key": "rorope_act",
              "rope_residual": "latent_mean"}
LEVERS = {
    "objective": ({}, {"objective": "attention"}),
    "distances": ({"rope_residual_distances": "attention"}, {}),
    "linear": ({"latent_norm": "linear"}, {}),
    "refit": ({}, {"refit": "values"}),
}


def _zoo(tmp_path: Path, name: str, mla: dict, init: dict) -> dict:
    return convert(ZOO_BASE, tmp_path / name, mla={**BEFORE_MLA, **mla},
                   init={"method": "activation", "calibration": CALIBRATION, **init})


@pytest.fixture(scope="module")
def before(tmp_path_factory) -> dict:
    return _zoo(tmp_path_factory.mktemp("before"), "before", {}, {})


@pytest.mark.parametrize("lever", list(LEVERS))
def test_each_lever_lowers_heldout_kl_on_a_trained_model(before, tmp_path, lever):
    mla, init = LEVERS[lever]
    after = _zoo(tmp_path, lever, mla, init)
    kl_before, kl_after = (r["heldout"]["kl_source_to_converted"] for r in (before, after))
    assert kl_after < 0.99 * kl_before, (lever, kl_before, kl_after)
    assert after["heldout"]["converted_perplexity"] < before["heldout"]["converted_perplexity"]


def test_refit_lowers_each_layers_value_path_error(tmp_path):
    report = _zoo(tmp_path, "refit", {}, {"refit": "values"})
    for layer in report["layers"]:
        assert layer["refit_error_after"] < layer["refit_error_before"], layer


def test_linear_latent_sits_in_the_norms_linear_regime(tmp_path):
    """The written latent's mean square stays below headroom·ε on real inputs, the input gain and the config's ε
    are what the plan says, and the norm is then a fixed scale."""
    out = tmp_path / "linear"
    _zoo(tmp_path, "linear", {"latent_norm": "linear"}, {})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rms_norm_eps"] == latent.LATENT_NORM_EPS
    model = load(out)
    ids = torch.randint(2, cfg["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
    seen = {}

    def grab(i):
        def hook(module, args, output):
            seen[i] = output[..., : cfg["kv_lora_rank"]].detach()
        return hook

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.kv_a_proj_with_mqa.register_forward_hook(grab(i))
    with torch.no_grad():
        model(ids)
    a = latent.linear_latent_scale(cfg["kv_lora_rank"], cfg["hidden_size"])
    sd = load_file(out / "model.safetensors")
    for i, c in seen.items():
        gain = a ** 0.5 / cfg["hidden_size"] ** 0.25
        assert torch.allclose(sd[f"model.layers.{i}.input_layernorm.weight"], torch.full((cfg["hidden_size"],), gain))
        ms = c.square().mean(-1)
        assert float(ms.max()) <= latent.LINEAR_HEADROOM * latent.LATENT_NORM_EPS
        n = latent.rms_normalize(c.double())
        fixed = c.double() / latent.LATENT_NORM_EPS ** 0.5
        assert latent.relative_error(fixed, n) < latent.LINEAR_HEADROOM / 2


def test_linear_latent_is_exact_at_full_width(source_factory, tmp_path):
    """One KV head, r_kv = hidden, every head dim rotary: exact, with no need for ‖y‖ to be constant (the source's
    ε is the one the output takes, so nothing else changes)."""
    src_dir = source_factory("llama", num_key_value_heads=1, rms_norm_eps=latent.LATENT_NORM_EPS)
    src = load(src_dir)
    convert(src_dir, tmp_path / "mla", mla={"kv_lora_rank": 64, "qk_rope_head_dim": 16, "latent_norm": "linear"})
    out = load(tmp_path / "mla")
    for seed in range(2):
        assert logit_error(src, out, src.config.vocab_size, seed) < 1e-4


@pytest.mark.parametrize("method", ["svd", "activation"])
def test_linear_latent_error_falls_with_rank(source_factory, corpus_dir, tmp_path, method):
    """One KV head with every key dim rotary: the latent carries the 16 value rows alone, so rank 16 is exact up to
    the linear regime's own bound: a per-token scale wobble of at most LINEAR_HEADROOM/2 = 0.05% (at full width,
    where ‖Q·y‖ is the same for every token, the wobble is gone: test above)."""
    src_dir = source_factory("llama", num_key_value_heads=1, rms_norm_eps=latent.LATENT_NORM_EPS)
    src = load(src_dir)
    cal = {"dataset": str(corpus_dir / "a_fit.jsonl"), "num_tokens": 4096, "heldout_tokens": 0, "seq_len": 64}
    errs = []
    for r in (4, 8, 16):
        convert(src_dir, tmp_path / f"r{r}", mla={"kv_lora_rank": r, "qk_rope_head_dim": 16, "latent_norm": "linear"},
                init={"method": method, "calibration": cal})
        errs.append(logit_error(src, load(tmp_path / f"r{r}"), src.config.vocab_size))
    assert errs[0] > errs[1] > errs[2], errs
    assert errs[2] < 1e-3, errs


@pytest.mark.parametrize("mla, init, needle", [
    ({"rope_residual_distances": "attention"}, {}, "need calibration data"),
    ({}, {"refit": "values"}, "need calibration data"),
    ({"latent_norm": "linear"}, {"method": "random"}, "mla.latent_norm: linear fits the latent, but init.method random"),
    ({}, {"method": "random", "objective": "attention"}, "init.objective: attention fits the latent"),
    ({}, {"objective": "attention", "kv_balance": True}, "init.kv_balance: objective attention weighs keys"),
    ({"rope_residual_distances": "attention", "rope_key": "mean"}, {}, "mla.rope_residual_distances: attention weighs"),
    ({}, {"key_weight": 0.0}, "init.key_weight: must be > 0"),
    ({}, {"method": "svd", "token_weights": "attention"}, "init.token_weights: attention weighs the calibration"),
    ({}, {"token_weight_power": 0.5}, "init.token_weight_power: only token_weights attention reads it"),
    ({}, {"token_weights": "attention", "token_weight_power": -1.0}, "init.token_weight_power: must be >= 0"),
    ({}, {"refit_ridge": -1.0}, "init.refit_ridge: must be >= 0"),
    ({}, {"objective": "attention", "query_moment": "uniform"}, "init.query_moment: only token_weights attention"),
    ({}, {"token_weights": "attention", "query_moment": "uniform"}, "init.query_moment: only token_weights attention"),
])
def test_lever_keys_are_refused_where_they_would_be_ignored(source_factory, tmp_path, mla, init, needle):
    from ecomla.convert.recipe import ConvertRecipe
    from ecomla.recipe.schema import RecipeError, load_recipe

    data = {"model": str(source_factory("llama")), "output_dir": str(tmp_path / "out"),
            "mla": {"kv_lora_rank": 16, "rope_key": "rorope", **mla}, "init": init}
    with pytest.raises(RecipeError) as err:
        load_recipe(ConvertRecipe, data=data)
    assert needle in str(err.value), str(err.value)
    assert not (tmp_path / "out").exists()


def test_one_adamw_step_breaks_a_linear_latent_unless_it_trains_at_natural_scale(source_factory, tmp_path):
    """A linear latent lives at about 1e-5 of its natural scale, through weights of about 1e-3 (and query
    rows stored x1/gain, kv_b_proj x sqrt(eps)/scale), and plain AdamW moves each weight by about lr per step
    whatever its size. One step at lr 1e-4 on the converted model's own next-token loss moves the linear latent's
    logits far more than the normalized latent's (SmolLM2 at 2.0x: KD loss 0.32 before one step, 13.6 after).
    The trainer's NaturalScale parametrization (every scaled tensor, the latent rows included, trained at its
    natural size) makes its step as small as the normalized one."""
    from ecomla.distill import models

    src = source_factory("llama", max_position_embeddings=256)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    moved = {}
    for case, latent_norm in (("normalize", "normalize"), ("linear", "linear"), ("linear, natural", "linear")):
        out = tmp_path / latent_norm
        if not out.exists():
            convert(src, out, mla={"kv_lora_rank": 16, "qk_rope_head_dim": 8, "latent_norm": latent_norm},
                    init={"method": "svd"})
        model = load(out)
        torch.manual_seed(0)
        with torch.no_grad():
            before = model(ids).logits
        model.train()
        if case == "linear, natural":
            scales = models.natural_scales(model.config, str(out))
            assert scales and all(n in dict(model.named_parameters()) for n in scales)
            models.train_at_natural_scale(model, scales, zero3=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        model(ids, labels=ids).loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            moved[case] = (model(ids).logits - before).abs().max().item()
    assert moved["linear"] > 5 * moved["normalize"], moved  # measured: 2.69 against 0.24
    assert moved["linear, natural"] < 2 * moved["normalize"], moved


def test_the_layout_is_in_the_config_and_its_natural_tensors_are_the_normalized_ones(source_factory, tmp_path):
    """config.json records the linear latent's layout; divided by its scales, the stored tensors are those of the
    same conversion with a normalized latent (unit input gain, orthonormal latent rows, the same kv_b_proj), so
    AdamW sees one model whichever latent norm was chosen. A checkpoint from before the config key is read from
    its conversion report."""
    from ecomla.convert import layout
    from ecomla.distill import models

    src = source_factory("llama", max_position_embeddings=256)
    mla = {"kv_lora_rank": 16, "qk_rope_head_dim": 8}
    convert(src, tmp_path / "m", mla={**mla, "latent_norm": "linear"}, init={"method": "svd"})
    convert(src, tmp_path / "n", mla=mla, init={"method": "svd"})
    lin, nrm = load(tmp_path / "m"), load(tmp_path / "n")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert layout.CONFIG_KEY in config and layout.CONFIG_KEY not in json.loads((tmp_path / "n" / "config.json").read_text())
    found = layout.linear_latent_of(lin.config)
    assert found == layout.LinearLatent.for_width(16, lin.config.hidden_size)
    stored, normalized = dict(lin.named_parameters()), dict(nrm.named_parameters())
    for name, s in found.stored_scales(lin.config).items():
        natural = stored[name].detach() / s.view(-1, *[1] * (stored[name].dim() - 1))
        ref = normalized[name].detach()
        if name.endswith("kv_a_proj_with_mqa.weight"):
            torch.testing.assert_close(natural[16:], ref[16:], rtol=1e-4, atol=1e-6)  # the RoPE-key rows
            torch.testing.assert_close(natural[:16] @ natural[:16].T, torch.eye(16), rtol=0, atol=1e-4)  # orthonormal
        else:  # kv_b_proj differs by the norm's ε alone: sqrt(1 + ε·width / (a²·r)) against 1
            torch.testing.assert_close(natural, ref, rtol=2e-3, atol=1e-6)
    assert models.natural_scales(nrm.config, str(tmp_path / "n")) == {}
    # An older checkpoint: no key in config.json, the conversion report says linear
    del config[layout.CONFIG_KEY]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    old = load(tmp_path / "m")
    assert layout.linear_latent_of(old.config) is None
    assert layout.linear_latent_of(old.config, tmp_path / "m") == found




def test_the_source_walk_hands_refit_the_attention_output_it_computes(source_factory):
    """`run_with_attention` returns what `run` returns, and beside it exactly what the layer's own attention
    gives on those inputs (the refit's target, read on the walk instead of computed a second time)."""
    from ecomla.convert.source import LayerRunner, causal_mask, inspect_source
    from ecomla.convert.walk import layer_tensors

    source = inspect_source(str(source_factory("llama")))
    runner = LayerRunner(source.config, torch.device("cpu"))
    layer = runner.build(1, layer_tensors(source.reader, 1))
    hidden = torch.randn(5, 12, source.config.hidden_size, generator=torch.Generator().manual_seed(0))
    out, attn = runner.run_with_attention(layer, hidden, batch_size=2)
    assert torch.equal(out, runner.run(layer, hidden, batch_size=2))
    pos = torch.arange(12)[None]
    with torch.no_grad():
        want = layer.self_attn(layer.input_layernorm(hidden), runner.rotary(hidden, pos), causal_mask(12, torch.float32, "cpu"))[0]
    torch.testing.assert_close(attn, want, rtol=1e-5, atol=1e-6)
    assert not layer.self_attn._forward_hooks  # the hook is gone after the walk


def test_attention_distances_read_the_first_blocks_only(source_factory):
    """rope_residual_distances=attention reads at most distance_tokens tokens (DISTANCE_TOKENS in a conversion):
    more blocks after them change nothing, also when the same pass reads every block's received masses; fewer
    blocks do."""
    from ecomla.convert import to_mla
    from ecomla.convert.plan import source_inv_freq
    from ecomla.convert.source import inspect_source
    from ecomla.convert.walk import layer_tensors, source_attention
    from ecomla.mla.rope import rope_split

    source = inspect_source(str(source_factory("llama")))
    shape = source.shape
    src = source_attention(layer_tensors(source.reader, 0))
    geo = to_mla.MLAGeometry(hidden=shape.hidden_size, n_heads=shape.num_heads, n_kv=shape.num_kv_heads,
                             head_dim=shape.head_dim, qk_rope_head_dim=8, kv_lora_rank=16, q_lora_rank=None,
                             query_scale=1.0, attention_bias=False, rope_key="rorope_act", rope_residual="latent_mean")
    split = rope_split("high", shape.head_dim, 8, interleave=True)
    T, inv_freq = 16, source_inv_freq(source)
    y = torch.randn(6 * T, shape.hidden_size, generator=torch.Generator().manual_seed(1))

    def read(blocks: torch.Tensor, received: bool = False, **kw) -> to_mla.AttentionReading:
        return to_mla.read_attention(geo, src, blocks, T, inv_freq, distance_tokens=3 * T, received=received, **kw)

    def rotation(blocks: torch.Tensor, received: bool = False) -> torch.Tensor:
        return to_mla.attention_rotation(geo, split, read(blocks, received).distances, inv_freq)

    first = rotation(y[: 3 * T])
    assert torch.equal(rotation(y), first)
    assert torch.equal(rotation(y, received=True), first)  # read in the same pass as every block's masses
    assert not torch.allclose(rotation(y[: 2 * T]), first)
    assert to_mla.DISTANCE_TOKENS == 16384
    # Read one or four blocks at a time (the pass holds at most max_probs probabilities): the same histogram, only
    # its first three blocks, and the same masses for every block
    whole = read(y, received=True)
    for per_pass in (1, 4):
        parts = read(y, received=True, max_probs=per_pass * geo.n_heads * T * T)
        torch.testing.assert_close(parts.distances, whole.distances, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(parts.received, whole.received, rtol=1e-6, atol=1e-9)
    assert whole.received.shape == (6 * T,)
    with pytest.raises(ValueError, match="not whole blocks"):
        read(y[: 5 * T + 3], received=True)


def test_token_weights_are_the_attention_each_token_receives_in_the_source_layer(source_factory):
    """init.token_weights=attention: each calibration token's weight is the attention mass transformers' own
    source layer (eager, with its RoPE and GQA) gives it in its block, averaged over the query heads; mean 1."""
    from ecomla.convert import to_mla
    from ecomla.convert.plan import source_inv_freq
    from ecomla.convert.source import LayerRunner, causal_mask, inspect_source
    from ecomla.convert.walk import layer_tensors, normalized_input, source_attention

    source = inspect_source(str(source_factory("llama")))
    shape, cfg = source.shape, source.config
    t = layer_tensors(source.reader, 1)
    geo = to_mla.MLAGeometry(hidden=shape.hidden_size, n_heads=shape.num_heads, n_kv=shape.num_kv_heads,
                             head_dim=shape.head_dim, qk_rope_head_dim=8, kv_lora_rank=16, q_lora_rank=None,
                             query_scale=1.0, attention_bias=False, rope_key="rorope_act", rope_residual="latent_mean")
    N, T = 3, 24
    h = torch.randn(N, T, shape.hidden_size, generator=torch.Generator().manual_seed(2)) * 3
    reading = to_mla.read_attention(geo, source_attention(t), normalized_input(h, cfg.rms_norm_eps), T,
                                    source_inv_freq(source), received=True)
    assert reading.distances is None
    got = reading.received.view(N, T)
    runner = LayerRunner(cfg, torch.device("cpu"), attn_implementation="eager")
    layer = runner.build(1, t)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        x = layer.input_layernorm(h)
        _, probs = layer.self_attn(x, position_embeddings=runner.rotary(x, pos),
                                   attention_mask=causal_mask(T, torch.float32, torch.device("cpu")))
    expected = probs.double().sum(2).mean(1)  # (N, T): each key's received mass, mean over query heads
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.mean(1), torch.ones(N, dtype=torch.float64))
    assert float(got[:, 0].min()) > 1.0  # the first key is read by every query


def test_token_weights_reach_the_kv_latent_and_rope_key_but_not_the_query_latent(tmp_path):
    """On the tiny world's trained base (peaked attention, a sink): token_weights attention moves the fitted latent
    rows and the up-projection; the query latent (q_a_proj, q_b_proj) stays as the uniform fit made it when its
    target does not depend on the weights (rope_key rorope, from the weights); with rorope_act the RoPE key's rows
    move too. Power 0 is the uniform fit, bit for bit."""
    cal = {**CALIBRATION, "num_tokens": 2048, "heldout_tokens": 0}

    def weights(name: str, rope_key: str, **init) -> dict:
        mla = {**BEFORE_MLA, "q_lora_rank": 64, "rope_key": rope_key}
        convert(ZOO_BASE, tmp_path / name, mla=mla, init={"method": "activation", "calibration": cal, **init})
        return load_file(tmp_path / name / "model.safetensors")

    r_kv = BEFORE_MLA["kv_lora_rank"]

    def moved(a: torch.Tensor, b: torch.Tensor) -> bool:
        return not torch.allclose(a, b, rtol=1e-3, atol=0)

    uniform = weights("uniform", "rorope")
    zero = weights("zero", "rorope", token_weights="attention", token_weight_power=0.0)
    attw = weights("attw", "rorope", token_weights="attention")
    assert all(torch.equal(uniform[k], zero[k]) for k in uniform)
    act_uniform = weights("act-uniform", "rorope_act")
    act_attw = weights("act-attw", "rorope_act", token_weights="attention")
    for i in range(4):
        p = f"model.layers.{i}.self_attn."
        for name in ("q_a_proj.weight", "q_b_proj.weight"):
            assert torch.equal(attw[p + name], uniform[p + name]), (i, name)
        kv_a, kv_a0 = attw[p + "kv_a_proj_with_mqa.weight"], uniform[p + "kv_a_proj_with_mqa.weight"]
        assert moved(kv_a[:r_kv], kv_a0[:r_kv]), i  # the latent rows
        assert torch.equal(kv_a[r_kv:], kv_a0[r_kv:]), i  # rorope's RoPE key comes from the weights alone
        assert moved(attw[p + "kv_b_proj.weight"], uniform[p + "kv_b_proj.weight"]), i
        kv_a, kv_a0 = act_attw[p + "kv_a_proj_with_mqa.weight"], act_uniform[p + "kv_a_proj_with_mqa.weight"]
        assert moved(kv_a[r_kv:], kv_a0[r_kv:]), i  # rorope_act's RoPE key, fitted to weighted key activations


def test_a_uniform_query_moment_moves_only_the_key_rows_weight(tmp_path):
    """init.query_moment=uniform under token_weights attention and objective attention: the key rows' query term
    counts every query alike, so the latent rows move, while the query latent, fitted under the same uniform moment
    either way, stays bit for bit; with token weights of power 0 (every token alike) the two moments are one, so the
    fits agree to rounding."""
    cal = {**CALIBRATION, "num_tokens": 2048, "heldout_tokens": 0}

    def weights(name: str, **init) -> dict:
        init = {"method": "activation", "objective": "attention", "token_weights": "attention", "calibration": cal,
                **init}
        convert(ZOO_BASE, tmp_path / name, mla={**BEFORE_MLA, "q_lora_rank": 64, "rope_key": "rorope"}, init=init)
        return load_file(tmp_path / name / "model.safetensors")

    r_kv = BEFORE_MLA["kv_lora_rank"]
    weighted, uniform = weights("weighted"), weights("uniform", query_moment="uniform")
    flat, flat_uniform = (weights("flat", token_weight_power=0.0),
                          weights("flat-uniform", token_weight_power=0.0, query_moment="uniform"))
    for i in range(4):
        name = f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"
        assert not torch.allclose(uniform[name][:r_kv], weighted[name][:r_kv], rtol=1e-3, atol=0), i
        for q in ("q_a_proj.weight", "q_b_proj.weight"):
            assert torch.equal(uniform[f"model.layers.{i}.self_attn.{q}"], weighted[f"model.layers.{i}.self_attn.{q}"])
        torch.testing.assert_close(flat_uniform[name], flat[name], rtol=1e-6, atol=1e-7)


def _next_states_match_a_run(out_dir: Path) -> None:
    from ecomla.convert.plan import make_plan
    from ecomla.convert.recipe import ConvertRecipe
    from ecomla.convert.refit import refit_values
    from ecomla.convert.source import LayerRunner
    from ecomla.convert.walk import layer_tensors
    from ecomla.io.checkpoint import CheckpointReader
    from ecomla.recipe.schema import load_recipe

    plan = make_plan(load_recipe(ConvertRecipe, out_dir / "ecomla_recipe.yaml"), force=True, progress=False)
    eager = LayerRunner(plan.config, torch.device("cpu"), attn_implementation="eager")
    sdpa = LayerRunner(plan.config, torch.device("cpu"))
    tensors = layer_tensors(CheckpointReader(out_dir), 1)
    g = torch.Generator().manual_seed(0)
    h_student = torch.randn(5, 32, plan.geometry.hidden, generator=g)
    h_src = h_student + 0.1 * torch.randn(h_student.shape, generator=g)
    wanted = torch.randn(h_student.shape, generator=g)
    out, entry, states = refit_values(plan.geometry, 1, tensors, eager, h_src, h_student, wanted, 0.01, 2,
                                      next_states=True)
    assert entry["refit_error_after"] < entry["refit_error_before"]
    ran = sdpa.run(sdpa.build(1, out), h_student, 2)
    torch.testing.assert_close(states, ran, rtol=1e-4, atol=1e-4 * float(ran.abs().max()))
    assert refit_values(plan.geometry, 1, tensors, eager, h_src, h_student, wanted, 0.01, 2)[2] is None


def test_the_refit_hands_on_the_refitted_layers_output(tmp_path):
    """The converted model's next calibration states that `refit_values` computes from what each head read equal
    a run of the refitted layer as written (stock DeepSeek-V3 layer, SDPA), so the walk needs no second run of
    the converted attention; without next_states it returns none."""
    _zoo(tmp_path, "refit", {"latent_norm": "linear"}, {"refit": "values"})
    _next_states_match_a_run(tmp_path / "refit")


def test_the_refits_next_states_carry_the_output_bias(source_factory, tmp_path):
    """The same with an o_proj bias (a Llama with attention_bias: the value bias folds into it)."""
    src = source_factory("llama", attention_bias=True)
    convert(src, tmp_path / "biased", mla={"kv_lora_rank": 16, "qk_rope_head_dim": 8, "q_lora_rank": 65},
            init={"method": "activation", "refit": "values", "calibration": CALIBRATION})
    assert "model.layers.1.self_attn.o_proj.bias" in load_file(tmp_path / "biased" / "model.safetensors")
    _next_states_match_a_run(tmp_path / "biased")
