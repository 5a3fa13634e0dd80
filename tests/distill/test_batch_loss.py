"""The trainer's data-to-loss path: padding and prompt masking change nothing on the tokens that count."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ecomla.data.packing import Doc, block_causal_mask, pack, position_ids, target_mask
from ecomla.data.shards import InMemoryPacked
from ecomla.distill.losses import KDLoss, LossConfig, TeacherDist, kd_per_token
from ecomla.distill.teacher import LiveTeacher
from ecomla.distill.trainer import batch_loss
from tests.tiny import make_source

SPEC = LossConfig(kind=KDLoss.FORWARD_KL, ce_weight=0.5)


def _models(tmp_path, tokenizer_dir):
    s = make_source(tmp_path / "s", tokenizer_dir, seed=1)
    t = make_source(tmp_path / "t", tokenizer_dir, seed=2, hidden_size=96)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    return load(s), load(t), AutoTokenizer.from_pretrained(s)


def _loss(student, teacher, data, ix, chunk=7):
    return batch_loss(student, LiveTeacher(teacher, 1.0), data.batch(ix), ix, SPEC, cross_document=False,
                      dtype=torch.float32, device=torch.device("cpu"), chunk_tokens=chunk)


def test_padding_tokens_do_not_matter(tmp_path, tokenizer_dir):
    student, teacher, tok = _models(tmp_path, tokenizer_dir)
    docs = []
    for text in ("the cat sat on a mat", "red fish in bowls"):
        ids = tok(text)["input_ids"] + [tok.eos_token_id]
        docs.append(Doc(ids, [1] * len(ids)))
    seqs = list(pack(docs, 48, pad_id=0))
    base = _loss(student, teacher, InMemoryPacked(seqs, 48), list(range(len(seqs))))
    for s in seqs:  # garbage in every padding slot
        pad = s.segments == 0
        s.tokens[pad] = torch.randint(1, 300, (int(pad.sum()),)).numpy()
    noisy = _loss(student, teacher, InMemoryPacked(seqs, 48), list(range(len(seqs))))
    assert base.tokens == noisy.tokens > 0
    torch.testing.assert_close(base.total, noisy.total, rtol=0, atol=0)


def test_prompt_masking_counts_only_targets(tmp_path, tokenizer_dir):
    """The loss equals a direct full-logits computation summed over assistant targets only."""
    student, teacher, tok = _models(tmp_path, tokenizer_dir)
    prompt = tok("the cat sat on")["input_ids"]
    answer = tok(" red fish")["input_ids"] + [tok.eos_token_id]
    seqs = list(pack([Doc(prompt + answer, [0] * len(prompt) + [1] * len(answer))], 32, pad_id=0))
    data = InMemoryPacked(seqs, 32)
    got = _loss(student, teacher, data, [0], chunk=3)
    assert got.tokens == len(answer)  # each answer token is predicted once; prompt tokens never are

    b = data.batch([0])
    seg = b["segments"]
    inputs = dict(input_ids=b["tokens"], position_ids=position_ids(seg), attention_mask=block_causal_mask(seg, torch.float32))
    with torch.no_grad():
        s_logits = student(**inputs).logits[0]
        t_logits = teacher(**inputs).logits[0]
    valid = target_mask(seg, b["loss_mask"])[0]
    kd = kd_per_token(s_logits[valid], TeacherDist.from_logits(t_logits[valid], 1.0), SPEC)
    ce = torch.nn.functional.cross_entropy(s_logits[valid], b["tokens"][0].roll(-1)[valid], reduction="none")
    torch.testing.assert_close(got.kd, kd.sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.total, (kd + 0.5 * ce).sum(), rtol=1e-5, atol=1e-5)


def test_loss_recompute_off_gives_the_same_loss_and_gradients(tmp_path, tokenizer_dir):
    """`loss.recompute: false` only trades memory for the backward's recomputation of each chunk."""
    student, teacher, tok = _models(tmp_path, tokenizer_dir)
    ids = [tok(t)["input_ids"] + [tok.eos_token_id] for t in ("the cat sat on a mat", "red fish in bowls")]
    docs = [Doc(i, [1] * len(i)) for i in ids]
    data = InMemoryPacked(list(pack(docs, 48, pad_id=0)), 48)
    grads = []
    for recompute in (True, False):
        spec = LossConfig(kind=KDLoss.FORWARD_KL, ce_weight=0.5, recompute=recompute)
        student.zero_grad(set_to_none=True)
        sums = batch_loss(student, LiveTeacher(teacher, 1.0), data.batch([0]), [0], spec, cross_document=False,
                          dtype=torch.float32, device=torch.device("cpu"), chunk_tokens=5)
        sums.total.backward()
        grads.append((float(sums.total), [p.grad.clone() for p in student.parameters() if p.grad is not None]))
    assert grads[0][0] == grads[1][0]
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b)
