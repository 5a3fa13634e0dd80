"""`ecomla.tinyworld.tokenizer`: a byte-level BPE that round-trips both domains and carries a chat template.

Proves: decode(encode(x)) == x for documents of both domains and for eval
contexts; the special tokens have fixed ids and stay single tokens; the chat
template renders roles and a generation prompt, rejects unknown roles, and is
prefix-stable, so `ecomla.data.packing.chat_documents` can mask prompts with it;
and training on the same documents gives the same tokenizer.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from ecomla.data.packing import chat_documents
from ecomla.tinyworld.corpus import DOMAINS, iter_documents
from ecomla.tinyworld.tokenizer import EOS, PAD, SPECIAL_TOKENS

TASKS_DIR = Path(__file__).resolve().parents[2] / "eval" / "tasks"


@pytest.mark.parametrize("domain", DOMAINS)
def test_round_trips_documents(tinyworld_tokenizer, domain):
    tok = tinyworld_tokenizer
    docs = list(itertools.islice(iter_documents(domain, "heldout", 0), 100))
    for text in docs + ["Ünïcode ✓ and  two  spaces\n\n\ttab"]:
        assert tok.decode(tok(text)["input_ids"]) == text
    tokens = sum(len(tok(t)["input_ids"]) for t in docs)
    assert sum(map(len, docs)) / tokens > 2.5  # merges were learned: well under one token per character


def test_round_trips_eval_contexts(tinyworld_tokenizer):
    with open(TASKS_DIR / "tinyworld" / "tinyworld_tracking.jsonl") as f:
        for row in map(json.loads, itertools.islice(f, 50)):
            text = row["context"] + " " + row["choices"][row["gold"]]
            assert tinyworld_tokenizer.decode(tinyworld_tokenizer(text)["input_ids"]) == text


def test_special_tokens(tinyworld_tokenizer):
    tok = tinyworld_tokenizer
    assert tok.eos_token == tok.bos_token == EOS and tok.pad_token == PAD
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    assert tok(f"a{EOS}b<|user|>")["input_ids"][1:] == [0, tok("b")["input_ids"][0], 3]
    assert len(tok) <= 2048


def test_chat_template_renders_and_is_prefix_stable(tinyworld_tokenizer):
    tok = tinyworld_tokenizer
    chat = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Where is the key?"},
        {"role": "assistant", "content": "In the box."},
    ]
    assert tok.apply_chat_template(chat, tokenize=False) == (
        "<|system|>Answer briefly.<|endoftext|><|user|>Where is the key?<|endoftext|>"
        "<|assistant|>In the box.<|endoftext|>"
    )
    assert tok.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True).endswith(
        "<|endoftext|><|assistant|>"
    )
    (doc,) = chat_documents([chat], tok)
    targets = [i for i, m in zip(doc.ids, doc.loss_mask) if m]
    assert tok.decode(targets) == "In the box." + EOS
    with pytest.raises(Exception, match="roles are system, user and assistant"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_saved_tokenizer_reloads(tinyworld_tokenizer_dir):
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tinyworld_tokenizer_dir)
    assert again.chat_template and again("Velmora lies on the river")["input_ids"]


def test_training_is_deterministic(tmp_path):
    from ecomla.tinyworld.tokenizer import train_tokenizer

    a = train_tokenizer(tmp_path / "a", vocab_size=512, num_docs=100)
    b = train_tokenizer(tmp_path / "b", vocab_size=512, num_docs=100)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
