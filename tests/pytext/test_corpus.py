"""The Python-text corpus: every document in exactly one split, by a pure function of its name.

Proves: the three splits of each domain share no document and together hold every document; a document's
split depends on its name alone (the same with or without other documents); the order is fixed; the mixed
stream alternates the domains; and the dataset keys `pytext:SPLIT[:DOMAIN]` read through the generic text
reader, with a clear error for a bad key.
"""

from __future__ import annotations

import itertools

import pytest

from ecomla.data.text import DataError, is_endless, iter_texts as read_texts, named_corpus
from ecomla.pytext import corpus
from ecomla.pytext.corpus import DOMAINS, SPLITS, documents, split_of


@pytest.mark.parametrize("domain", DOMAINS)
def test_splits_partition_the_domain(domain):
    every = [d.name for d in corpus._SOURCES[domain]()]
    by_split = {s: [d.name for d in documents(domain, s)] for s in SPLITS}
    names = [n for s in SPLITS for n in by_split[s]]
    assert sorted(names) == sorted(every)
    assert len(set(names)) == len(names)
    assert all(by_split[s] for s in SPLITS), {s: len(v) for s, v in by_split.items()}


def test_a_documents_split_is_a_function_of_its_name_alone():
    assert split_of("prose", "topics/assert") == split_of("prose", "topics/assert")
    # the same name in the other domain is hashed with its domain, so splits are drawn independently
    splits = {split_of("code", f"pkg/mod{i}.py") for i in range(200)}
    assert splits == set(SPLITS)
    shares = [sum(split_of("code", f"pkg/mod{i}.py") == s for i in range(2000)) / 2000 for s in SPLITS]
    assert shares == pytest.approx([corpus.SHARES["code"][s] / 100 for s in SPLITS], abs=0.03)


def test_order_is_fixed_and_not_alphabetical():
    first = [d.name for d in documents("prose", "heldout")]
    assert first == [d.name for d in documents("prose", "heldout")]
    assert first != sorted(first)


def test_mixed_stream_alternates_domains_until_one_runs_out():
    prose = [d.text for d in documents("prose", "train")]
    code = [d.text for d in itertools.islice(documents("code", "train"), len(prose) + 3)]
    mixed = list(itertools.islice(corpus.iter_texts("train"), 2 * len(prose) + 3))
    assert mixed[: 2 * len(prose)] == [t for pair in zip(prose, code) for t in pair]
    assert mixed[2 * len(prose):] == code[len(prose): len(prose) + 3]


def test_dataset_keys_read_through_the_generic_reader():
    assert named_corpus("pytext:heldout:code").prefix == "pytext"
    assert not is_endless("pytext:train") and is_endless("tinyworld:train")
    assert named_corpus("some/hub-dataset") is None
    got = list(itertools.islice(read_texts("pytext:heldout:prose"), 3))
    assert got == [d.text for d in documents("prose", "heldout")[:3]]
    with pytest.raises(DataError, match="pytext:SPLIT or pytext:SPLIT:DOMAIN"):
        next(read_texts("pytext:test:prose"))
