"""`SharedContextLM` (ecomla/eval/shared_context.py) against lm-eval's own HFLM, request by request."""

from __future__ import annotations

import json

import pytest
import torch
from lm_eval.models.huggingface import HFLM

from ecomla.eval.shared_context import SharedContextLM, batches
from tests.eval.test_eval import recipe


def _requests(vocab: int) -> list:
    """Items of 4 choices (contexts of 9, 1, 14 and 4 tokens, choices of 1-6 tokens) and a lone request,
    interleaved as lm-eval hands them over (a one-token context goes through HFLM)."""
    g = torch.Generator().manual_seed(0)

    def toks(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    out = []
    for ctx_len in (9, 1, 14, 4):
        context = toks(ctx_len)
        for n in (1, 3, 6, 2):
            out.append((("ctx", "choice"), context, toks(n)))
    out.append((("lone", "request"), toks(5), toks(4)))
    return [out[i] for i in (0, 4, 8, 12, 16, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)]


@pytest.fixture
def lrkv_model(models, tmp_path):
    """A tiny LRKV model (ecomla's own architecture, its own cache class) beside the base's tokenizer."""
    import shutil

    from tests.lrkv.helpers import tiny_lrkv

    path = tmp_path / "lrkv"
    tiny_lrkv().save_pretrained(path)
    for f in models["base"].iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


# batch_size 4: one 4-choice item a batch; 16: the three items of 2+ context tokens in one batch, their contexts
# (13, 8 and 3 tokens into the cache) left-padded; 8: two items, then one.
@pytest.mark.parametrize("which,batch_size", [("base", 4), ("mla", 4), ("base", 16), ("mla", 16), ("mla", 8),
                                              ("lrkv", 16)])
def test_the_same_loglikelihoods_as_hflm(models, lrkv_model, which, batch_size):
    path = str(lrkv_model if which == "lrkv" else models[which])
    plain = HFLM(pretrained=path, tokenizer=path, device="cpu", dtype="float32", batch_size=4)
    shared = SharedContextLM(pretrained=path, tokenizer=path, device="cpu", dtype="float32", batch_size=batch_size)
    requests = _requests(plain.model.config.vocab_size)
    context = list(requests[0][1])  # one choice of the first item: the model's own greedy tokens
    for _ in range(3):
        with torch.no_grad():
            context.append(int(plain.model(torch.tensor([context])).logits[0, -1].argmax()))
    requests[5] = (requests[5][0], requests[0][1], context[len(requests[0][1]):])
    seen, calls = {}, {}
    for name, lm in (("plain", plain), ("shared", shared)):  # tokens the model embeds (both pad with id 0)
        seen[name] = calls[name] = 0

        def count(_m, args, _out, name=name):
            seen[name] += int((args[0] != 0).sum())
            calls[name] += 1

        lm.model.get_input_embeddings().register_forward_hook(count)
    want = plain._loglikelihood_tokens(requests, disable_tqdm=True)
    got = shared._loglikelihood_tokens(requests, disable_tqdm=True)
    assert len(got) == len(want)
    for (lp, greedy), (lp_want, greedy_want) in zip(got, want):
        assert abs(lp - lp_want) < 1e-4 * max(1.0, abs(lp_want)), (lp, lp_want)
        assert greedy == greedy_want
    assert any(greedy for _, greedy in want) and not all(greedy for _, greedy in want)
    # Every context but its last token ran once per item, not once per choice.
    assert 0 < seen["shared"] < 0.75 * seen["plain"], seen
    # Two passes a batch of items (contexts, then choices), after HFLM's own batches of the other 5 requests and
    # the one two-token pass that asks whether the model's cache may be padded.
    assert calls["shared"] == {4: 2 + 1 + 2 * 3, 8: 1 + 1 + 2 * 2, 16: 1 + 1 + 2 * 1}[batch_size], calls


def test_fp16_runs_one_item_a_batch(models):
    """fp16's eager mask can turn a fully padded context row into NaN, so no context is padded there."""
    path = str(models["mla"])
    shared = SharedContextLM(pretrained=path, tokenizer=path, device="cpu", dtype="float16", batch_size=16)
    assert shared._cache_support() == (True, False)
    calls = []
    shared.model.get_input_embeddings().register_forward_hook(lambda *_: calls.append(1))
    requests = _requests(shared.model.config.vocab_size)
    got = shared._loglikelihood_tokens(requests, disable_tqdm=True)
    assert len(got) == len(requests) and all(lp == lp for lp, _ in got)  # no NaN
    assert len(calls) == 1 + 2 * 3  # HFLM's one batch of the other 5 requests, then two passes an item
    fp32 = SharedContextLM(pretrained=path, tokenizer=path, device="cpu", dtype="float32", batch_size=16)
    assert fp32._cache_support() == (True, True)


def test_batches_fill_up_to_the_width_with_whole_items():
    assert batches([[0, 1, 2, 3], [4, 5], [6, 7, 8, 9], [10]], 6) == [[[0, 1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10]]]
    assert batches([[0, 1, 2, 3, 4, 5, 6]], 4) == [[[0, 1, 2, 3, 4, 5, 6]]]  # an item wider than the batch: alone
    assert batches([[0, 1], [2, 3]], 1) == [[[0, 1]], [[2, 3]]]
    assert batches([], 16) == []


def test_eval_scores_the_same_with_and_without_it(models, tmp_path):
    from ecomla.eval.runner import run_eval

    out = {}
    for share in (True, False):
        (tmp_path / str(share)).mkdir()
        r = recipe(tmp_path / str(share), models, share_context=share, limit=8)
        result = json.loads((run_eval(r, progress=False) / "results" / "mla-4x.json").read_text())
        out[share] = result["tasks"]
    for task, numbers in out[False].items():
        for metric, value in numbers["all_metrics"].items():
            assert out[True][task]["all_metrics"][metric] == pytest.approx(value, rel=1e-5), (task, metric)
