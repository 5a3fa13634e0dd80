"""Intermediate-layer distillation: the per-layer loss, its hooks, and ILD runs of the trainer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ecomla.distill.layers import LayerCatch
from ecomla.distill.losses import ILDTarget, LossConfig, LossConfigError, attention_kl_per_token, ild_per_token
from tests.distill import world as w


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer_dir, corpus_dir):
    return w.build_world(tmp_path_factory.mktemp("world"), tokenizer_dir, corpus_dir)


def _ild_recipe(world, out, **loss):
    """The student's own source (world['root']/'base', a Llama) is the live teacher and the ILD source."""
    r = w.recipe(world, out, loss={"ild_weight": 1.0, **loss}, train={"total_tokens": 256 * 8})
    r["teacher"] = {"model": str(world["root"] / "base")}
    return r


def test_ild_per_token_is_a_relative_error_that_only_the_student_learns_from():
    gen = torch.Generator().manual_seed(0)
    t = [torch.randn(5, 8, generator=gen) * s for s in (1.0, 100.0)]  # a small and a large residual stream
    h = [x.clone().requires_grad_(True) for x in t]
    assert torch.equal(ild_per_token(h, t), torch.zeros(5))
    noisy = [(x + 0.1 * torch.randn(x.shape, generator=gen) * x.norm(dim=-1, keepdim=True) / 8**0.5).requires_grad_(True)
             for x in t]
    src = [x.clone().requires_grad_(True) for x in t]
    loss = ild_per_token(noisy, src)
    assert loss.shape == (5,) and (loss > 0).all() and (loss < 0.1).all()  # ~0.01 for both layers
    loss.sum().backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in noisy)
    assert all(x.grad is None for x in src)  # the source carries no gradient
    with pytest.raises(ValueError, match="same number of layers"):
        ild_per_token(noisy[:1], t)


def test_attention_kl_per_token_is_zero_for_the_same_rows_and_only_the_student_learns_from_it():
    gen = torch.Generator().manual_seed(0)
    causal = torch.ones(6, 6).tril().bool()  # (T, T): query t sees keys 0..t
    def rows(scale):  # two layers of (N=6, H=3, T=6) attention rows, the causal mask's keys exactly 0
        return [torch.randn(6, 3, 6, generator=gen).mul(scale).masked_fill(~causal[:, None, :], float("-inf"))
                .softmax(-1) for _ in range(2)]
    a = rows(3.0)
    b = [x.clone().requires_grad_(True) for x in a]
    assert torch.equal(attention_kl_per_token(b, a), torch.zeros(6))
    logits = [torch.randn(6, 3, 6, generator=gen).requires_grad_(True) for _ in range(2)]
    student = [z.masked_fill(~causal[:, None, :], float("-inf")).softmax(-1) for z in logits]
    src = [x.clone().requires_grad_(True) for x in a]
    kl = attention_kl_per_token(student, src)
    assert kl.shape == (6,) and torch.isfinite(kl).all()
    assert kl[0] == 0 and (kl[1:] > 0).all()  # the first token has one key: every head's row is [1, 0, ...]
    by_hand = sum((x * (x.log() - y.log())).nan_to_num().sum(-1).mean(-1) for x, y in zip(a, student)) / 2
    torch.testing.assert_close(kl, by_hand.detach())
    kl.sum().backward()
    assert all(z.grad is not None and z.grad.abs().sum() > 0 for z in logits)
    assert all(x.grad is None for x in src)
    with pytest.raises(ValueError, match="same number of query heads"):
        attention_kl_per_token([s[:, :2] for s in student], a)


def test_attention_maps_need_as_many_query_heads_on_both_sides():
    from types import SimpleNamespace

    from ecomla.distill.models import check_layers

    student = SimpleNamespace(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    fewer = SimpleNamespace(num_hidden_layers=2, hidden_size=64, num_attention_heads=2)
    assert check_layers(student, fewer, "teacher.ild_model", "src") is None  # hidden states: heads do not matter
    assert "2 query heads, the student 4" in check_layers(student, fewer, "teacher.ild_model", "src", heads=True)


def test_ild_config_checks():
    assert LossConfig(kind="none", kd_weight=0.0, ce_weight=0.0, ild_weight=1.0).uses_ild  # ILD alone is training
    with pytest.raises(LossConfigError, match="nothing to train"):
        LossConfig(kind="none", kd_weight=0.0, ce_weight=0.0)
    with pytest.raises(LossConfigError, match="teacher forcing"):
        LossConfig(ild_weight=1.0, ild_inputs="source")  # KD on a teacher-forced stack is not the student's KD
    with pytest.raises(LossConfigError, match="ild_weight: must be >= 0"):
        LossConfig(ild_weight=-1.0)


def test_layer_catch_sees_blocks_and_attention_and_feeds_inputs(world):
    src = AutoModelForCausalLM.from_pretrained(world["root"] / "base").eval()
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        src.get_decoder()(input_ids=ids, output_hidden_states=True)  # transformers keeps a hook of its own for this
    hooks = len(src.get_decoder().layers[0]._forward_hooks)
    with torch.no_grad():
        with LayerCatch(ILDTarget.BLOCK, inputs=True).on(src) as block:
            out = src.get_decoder()(input_ids=ids, output_hidden_states=True)
        with LayerCatch(ILDTarget.ATTENTION).on(src) as attn:
            src.get_decoder()(input_ids=ids)
    n = src.config.num_hidden_layers
    assert len(block.outputs) == len(attn.outputs) == n and block.caught and attn.caught
    assert all(o.shape == (2, 12, src.config.hidden_size) for o in block.outputs + attn.outputs)
    torch.testing.assert_close(block.inputs[1], block.outputs[0])  # layer 1 reads layer 0's output
    assert not torch.allclose(attn.outputs[0], block.outputs[0])  # before the residual add and the MLP
    for i in range(n - 1):  # transformers' own record of the residual stream (its last entry is after the norm)
        torch.testing.assert_close(block.outputs[i], out.hidden_states[i + 1])
    assert len(src.get_decoder().layers[0]._forward_hooks) == hooks  # ours are gone after the block
    # Teacher forcing: layer i reads the given inputs; fed the model's own inputs, it computes its own outputs
    with torch.no_grad(), LayerCatch(ILDTarget.BLOCK, feed=block.inputs).on(src) as fed:
        src.get_decoder()(input_ids=torch.zeros_like(ids))  # other tokens: only layer 0's embeddings differ...
    torch.testing.assert_close(fed.outputs[1:], block.outputs[1:])  # ... and they are replaced by the feed


def test_layer_catch_sees_attention_maps_of_eager_attention_only(world):
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    for path in (world["root"] / "base", world["student"]):  # the Llama source and its MLA conversion
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        with torch.no_grad(), LayerCatch(ILDTarget.ATTENTION_MAP).on(model) as maps:
            model.get_decoder()(input_ids=ids)
        heads = model.config.num_attention_heads
        assert maps.caught and all(m.shape == (2, heads, 12, 12) for m in maps.outputs)
        torch.testing.assert_close(maps.outputs[0].sum(-1), torch.ones(2, heads, 12))  # probabilities
        assert maps.outputs[0].triu(1).abs().max() == 0  # causal: no future key
        valid = torch.zeros(2, 12, dtype=torch.bool)
        valid[0, 3], valid[1, 5] = True, True
        rows = maps.rows(valid)
        assert rows[0].shape == (2, heads, 12)
        torch.testing.assert_close(rows[0][1], maps.outputs[0][1, :, 5])  # query 5 of sequence 1, every head
    sdpa = AutoModelForCausalLM.from_pretrained(world["student"], attn_implementation="sdpa").eval()
    with pytest.raises(RuntimeError, match="attn_implementation='eager'"):
        with torch.no_grad(), LayerCatch(ILDTarget.ATTENTION_MAP).on(sdpa):
            sdpa.get_decoder()(input_ids=ids)


def test_the_attention_map_loss_is_zero_for_the_source_and_trains_only_the_student(world):
    from ecomla.distill.trainer import batch_loss

    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens, "segments": torch.ones_like(tokens), "loss_mask": torch.ones_like(tokens, dtype=torch.bool)}
    spec = LossConfig(kind="none", kd_weight=0.0, ce_weight=0.0, ild_weight=1.0, ild_target="attention_map")
    source = AutoModelForCausalLM.from_pretrained(world["root"] / "base", attn_implementation="eager")

    def loss(student):
        return batch_loss(student, None, batch, [0, 1], spec, cross_document=False, dtype=torch.float32,
                          device=torch.device("cpu"), chunk_tokens=64, ild_source=source)

    same = AutoModelForCausalLM.from_pretrained(world["root"] / "base", attn_implementation="eager")
    assert float(loss(same).ild.detach()) == 0.0
    student = AutoModelForCausalLM.from_pretrained(world["student"], attn_implementation="eager")
    sums = loss(student)
    assert float(sums.ild) > 0 and torch.equal(sums.total, sums.ild)
    sums.total.backward()
    grads = {n for n, p in student.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert any("kv_a_proj_with_mqa" in n for n in grads) and any("q_proj" in n for n in grads)
    last = f"layers.{student.config.num_hidden_layers - 1}."  # nothing after the last attention map is trained
    assert not any(last + "mlp" in n or last + "self_attn.o_proj" in n or "lm_head" in n for n in grads), grads
    assert all(p.grad is None for p in source.parameters())


def test_the_ild_loss_is_zero_for_the_source_itself_and_positive_for_its_conversion(world, tmp_path):
    """A run whose student is its own ILD source logs ILD 0 at every step; the converted student's is positive
    and falls when ILD is all it trains on (KD and CE still logged); gradients reach the student only."""
    same = _ild_recipe(world, tmp_path / "same", kind="none", kd_weight=0.0)
    same["student"] = str(world["root"] / "base")
    same["train"]["lr"] = 0.0  # the student stays the source: ILD is exactly 0 at every step
    proc = w.run(w.write_recipe(tmp_path / "same.yaml", same))
    assert proc.returncode == 0, w.errors(proc)
    assert [r["ild"] for r in w.metrics(tmp_path / "same") if not r.get("final_eval")] == [0.0] * 8
    alone = _ild_recipe(world, tmp_path / "alone", kd_weight=0.0)
    proc = w.run(w.write_recipe(tmp_path / "alone.yaml", alone))
    assert proc.returncode == 0, w.errors(proc)
    rows = [r for r in w.metrics(tmp_path / "alone") if not r.get("final_eval")]
    ild = [r["ild"] for r in rows]
    assert ild[0] > 0 and sum(ild[-3:]) < 0.9 * sum(ild[:3]), ild
    assert all(r["loss"] == pytest.approx(r["ild"]) and r["kd"] > 0 for r in rows)  # KD logged, not trained


def test_ild_gradients_reach_the_student_and_not_the_source(world):
    from ecomla.distill.trainer import batch_loss

    student = AutoModelForCausalLM.from_pretrained(world["student"])
    source = AutoModelForCausalLM.from_pretrained(world["root"] / "base")
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens, "segments": torch.ones_like(tokens), "loss_mask": torch.ones_like(tokens, dtype=torch.bool)}
    spec = LossConfig(kind="none", kd_weight=0.0, ce_weight=0.0, ild_weight=1.0)
    sums = batch_loss(student, None, batch, [0, 1], spec, cross_document=False, dtype=torch.float32,
                      device=torch.device("cpu"), chunk_tokens=64, ild_source=source)
    assert float(sums.ild) > 0 and torch.equal(sums.total, sums.ild)
    sums.total.backward()
    grads = {n for n, p in student.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert any("self_attn.kv_b_proj" in n for n in grads) and any("mlp" in n for n in grads)
    assert all(p.grad is None for p in source.parameters())


@pytest.mark.slow
def test_ild_and_kd_give_the_same_losses_on_one_and_two_processes(world, tmp_path):
    """The ILD term is a sum over tokens, normalized by the step's tokens like KD: one process with 2-step
    accumulation and two processes (ZeRO-2) train on the same sequences and log the same losses."""
    runs = {}
    for procs in (1, 2):
        r = _ild_recipe(world, tmp_path / f"p{procs}", ild_weight=0.5)
        r["train"] = {**r["train"], "micro_batch_size": 1, "total_tokens": 256 * 4}
        r["deepspeed"] = {"zero_stage": 2}
        proc = w.run(w.write_recipe(tmp_path / f"p{procs}.yaml", r), procs)
        assert proc.returncode == 0, w.errors(proc)
        runs[procs] = [x for x in w.metrics(tmp_path / f"p{procs}") if not x.get("final_eval")]
    for a, b in zip(runs[1], runs[2]):
        for key in ("loss", "kd", "ild"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), (a["step"], key, a[key], b[key])
    assert runs[1][0]["ild"] > 0


def test_an_attention_map_run_loads_eager_attention_and_its_loss_falls(world, tmp_path):
    """ILD on attention maps alone, the student's source live: the trainer loads both models with eager attention
    (else the hooks raise) and the KL of the attention rows falls as it trains."""
    r = _ild_recipe(world, tmp_path / "maps", kd_weight=0.0, ild_target="attention_map")
    proc = w.run(w.write_recipe(tmp_path / "maps.yaml", r))
    assert proc.returncode == 0, w.errors(proc)
    ild = [x["ild"] for x in w.metrics(tmp_path / "maps") if not x.get("final_eval")]
    assert ild[0] > 0 and sum(ild[-3:]) < 0.9 * sum(ild[:3]), ild
