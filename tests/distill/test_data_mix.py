"""`data.train.mix` and `max_tokens`: a fixed mixture of text sources for distillation.

Proves: a source's documents come first, then each mix part's, each within its own max_documents / max_tokens
(the last document cut to the exact token count); document_tokens keeps each document's first tokens, so a
token budget spans more documents; shards that `prepare-data` packed for one mixture are not read
for another; and the recipe refuses nested mixes, prepared mix parts and empty limits with the key that is wrong.
"""

from __future__ import annotations

import pytest

from ecomla.distill.data import documents, open_dataset, prepare_data
from ecomla.distill.recipe import DataSource, DistillRecipe
from ecomla.recipe.schema import RecipeError, load_recipe


@pytest.fixture
def tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def ids_of(path, tok, n=None) -> list[list[int]]:
    """Every document of a jsonl corpus file, tokenized as the trainer does (EOS ended)."""
    src = DataSource(dataset=str(path), max_documents=n)
    return [d.ids for d in documents(src, tok)]


def test_mix_parts_follow_the_source_each_within_its_own_limits(corpus_dir, tok):
    a, b = corpus_dir / "a_fit.jsonl", corpus_dir / "b_fit.jsonl"
    a_docs, b_docs = ids_of(a, tok, 3), ids_of(b, tok, 40)
    budget = sum(len(d) for d in b_docs[:5]) + 3  # five whole documents of b and three tokens of the sixth
    src = DataSource(dataset=str(a), max_documents=3, mix=[DataSource(dataset=str(b), max_tokens=budget)])
    got = [d.ids for d in documents(src, tok)]
    assert got[:3] == a_docs
    assert got[3:] == b_docs[:5] + [b_docs[5][:3]]
    assert sum(len(d) for d in got[3:]) == budget
    masks = [d.loss_mask for d in documents(src, tok)]
    assert [len(m) for m in masks] == [len(d) for d in got]


def test_max_tokens_alone_cuts_the_stream_and_max_documents_still_applies(corpus_dir, tok):
    a = corpus_dir / "a_fit.jsonl"
    full = ids_of(a, tok, 10)
    first = len(full[0])
    assert [d.ids for d in documents(DataSource(dataset=str(a), max_tokens=first), tok)] == [full[0]]
    two = DataSource(dataset=str(a), max_documents=2, max_tokens=10**9)
    assert [d.ids for d in documents(two, tok)] == full[:2]


def test_document_tokens_spreads_a_token_budget_over_more_documents(corpus_dir, tok):
    a = corpus_dir / "a_fit.jsonl"
    full = ids_of(a, tok, 40)
    n = sorted(len(d) for d in full)[len(full) // 2]  # the median length: about half the documents are cut
    assert any(len(d) > n for d in full) and any(len(d) < n for d in full)
    cut = [d.ids for d in documents(DataSource(dataset=str(a), max_documents=40, document_tokens=n), tok)]
    assert cut == [d[:n] for d in full]  # every document's first n tokens, the shorter ones whole
    budget = sum(len(d) for d in full[:5])
    whole = list(documents(DataSource(dataset=str(a), max_tokens=budget), tok))
    spread = list(documents(DataSource(dataset=str(a), max_tokens=budget, document_tokens=n), tok))
    assert len(whole) == 5 and len(spread) > 5
    assert sum(len(d.ids) for d in spread) == budget
    assert [len(d.loss_mask) for d in spread] == [len(d.ids) for d in spread]


def distill_recipe(tmp_path, train: dict) -> DistillRecipe:
    return load_recipe(DistillRecipe, data={
        "student": "unused", "output_dir": str(tmp_path / "run"), "teacher": {"source": "none"}, "loss": {"kind": "none", "kd_weight": 0.0, "ce_weight": 1.0},
        "data": {"train": train, "seq_len": 64},
        "train": {"total_tokens": 128, "global_batch_tokens": 64, "micro_batch_size": 1},
    })


def test_shards_of_one_mixture_are_not_read_for_another(corpus_dir, tok, tmp_path):
    a, b = str(corpus_dir / "a_fit.jsonl"), str(corpus_dir / "b_fit.jsonl")
    train = {"dataset": a, "max_documents": 4, "mix": [{"dataset": b, "max_tokens": 300}]}
    r = distill_recipe(tmp_path, train)
    prepare_data(r, tok)
    same = open_dataset(r.data.train, tok, 64, "data.train", r.output_dir)
    assert type(same).__name__ == "PackedDataset"  # the shards, read back
    other = distill_recipe(tmp_path, {**train, "mix": [{"dataset": b, "max_tokens": 200}]})
    packed = open_dataset(other.data.train, tok, 64, "data.train", other.output_dir)
    assert type(packed).__name__ != "PackedDataset"  # packed again in memory, not the other mixture's shards
    tokens = lambda ds: sum(int((ds.batch([i])["segments"] > 0).sum()) for i in range(len(ds)))  # noqa: E731
    assert tokens(same) - tokens(packed) == 100
    cut = distill_recipe(tmp_path, {**train, "document_tokens": 8})
    assert type(open_dataset(cut.data.train, tok, 64, "data.train", cut.output_dir)).__name__ != "PackedDataset"


@pytest.mark.parametrize("train, key", [
    ({"dataset": "x.jsonl", "mix": [{"dataset": "y.jsonl", "mix": [{"dataset": "z.jsonl"}]}]}, "mix[0].mix"),
    ({"dataset": "x.jsonl", "mix": [{"prepared": "shards/"}]}, "mix[0].prepared"),
    ({"prepared": "shards/", "mix": [{"dataset": "y.jsonl"}]}, "mix"),
    ({"dataset": "x.jsonl", "mix": [{"dataset": "y.jsonl", "max_tokens": 0}]}, "mix[0].max_tokens"),
    ({"dataset": "x.jsonl", "max_documents": 0}, "max_documents"),
    ({"dataset": "x.jsonl", "mix": [{"dataset": "y.jsonl", "document_tokens": 0}]}, "mix[0].document_tokens"),
    ({"dataset": "x.jsonl", "format": "chat", "document_tokens": 512}, "document_tokens"),
    ({"prepared": "shards/", "document_tokens": 512}, "document_tokens"),
    ({"prepared": "shards/", "max_tokens": 512}, "max_tokens"),
    ({"dataset": "x.jsonl", "mix": [{"max_tokens": 5}]}, "mix[0].prepared"),
])
def test_bad_mixtures_are_refused_with_the_key_to_fix(tmp_path, train, key):
    with pytest.raises(RecipeError) as err:
        distill_recipe(tmp_path, train)
    assert f"data.train.{key}" in str(err.value)
