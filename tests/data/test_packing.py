"""`ecomla.data.packing`: documents, boundary-respecting packing, and the micro-batch helpers.

Proves: whole documents are packed greedily and never split unless longer than
seq_len (then cut into seq_len pieces); segments number documents and 0 marks
padding, which is never a target; positions restart per document; the target
mask follows "logits at t predict token t+1 of the same document"; the block
causal mask forbids future, cross-document and padding keys; and a random tiny
Llama given two packed documents with that mask and those positions produces
the same logits for the second document as when it runs alone. Chat documents
make exactly the assistant content (and its end token) targets.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from ecomla.data.packing import (
    Doc,
    block_causal_mask,
    chat_documents,
    pack,
    position_ids,
    target_mask,
    text_documents,
)
from ecomla.data.text import DataError, iter_texts

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def doc(n: int, start: int = 1, mask: list[int] | None = None) -> Doc:
    ids = list(range(start, start + n))
    return Doc(ids, mask if mask is not None else [1] * n)


def to_batch(seqs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    stack = lambda name: torch.stack([torch.from_numpy(getattr(s, name).astype("int64")) for s in seqs])
    return stack("tokens"), stack("loss_mask"), stack("segments")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


# ---------------------------------------------------------------- documents


def test_text_documents_tokenize_append_eos_and_mask_all(tokenizer, corpus_dir):
    texts = list(iter_texts(str(corpus_dir / "a_fit.jsonl")))[:5]
    docs = list(text_documents(texts, tokenizer, batch_size=2))  # batches of 2, 2, 1 keep order
    assert len(docs) == 5
    for text, (ids, mask) in zip(texts, docs):
        assert ids[-1] == tokenizer.eos_token_id
        assert ids[:-1] == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert mask == [1] * len(ids)


def test_chat_documents_targets_are_the_assistant_content(tokenizer):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = TEMPLATE
    messages = [
        {"role": "system", "content": "the cat sat"},
        {"role": "user", "content": "market prices rose"},
        {"role": "assistant", "content": "bonds fell sharply"},
        {"role": "user", "content": "red fish"},
        {"role": "assistant", "content": "one two three bowls"},
    ]
    (ids, mask), = chat_documents([messages], tok)
    full = tok.apply_chat_template(messages, tokenize=True)
    assert ids == list(full["input_ids"] if hasattr(full, "keys") else full)
    assert len(mask) == len(ids) and set(mask) == {0, 1}
    # Targets, run by run, decode to each assistant reply plus its end token; nothing else is a target.
    runs, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    runs.append(run) if run else None
    assert [tok.decode(r) for r in runs] == ["bonds fell sharply<|endoftext|>", "one two three bowls<|endoftext|>"]
    prompt = [i for i, m in zip(ids, mask) if not m]
    assert "<|assistant|>" in tok.decode(prompt) and "market prices rose" in tok.decode(prompt)


def test_chat_documents_without_template_or_with_unstable_template(tokenizer):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = None
    with pytest.raises(DataError, match="tokenizer_config.json"):
        list(chat_documents([[{"role": "user", "content": "hi"}]], tok))
    tok.chat_template = "{% for m in messages|reverse %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    rows = [[{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"}]]
    with pytest.raises(DataError, match="not prefix-stable"):
        list(chat_documents(rows, tok))


# ---------------------------------------------------------------- pack


def test_pack_places_whole_documents_and_pads():
    docs = [doc(3, 10), doc(4, 20), doc(5, 30), doc(2, 40)]  # 3+4 fit in 8; 5 does not fit after them
    seqs = list(pack(docs, seq_len=8, pad_id=0))
    assert len(seqs) == 2
    assert seqs[0].tokens.tolist() == [10, 11, 12, 20, 21, 22, 23, 0]
    assert seqs[0].segments.tolist() == [1, 1, 1, 2, 2, 2, 2, 0]
    assert seqs[1].tokens.tolist() == [30, 31, 32, 33, 34, 40, 41, 0]
    assert seqs[1].segments.tolist() == [1, 1, 1, 1, 1, 2, 2, 0]
    for s in seqs:
        assert s.tokens.dtype.name == "int32" and s.loss_mask.dtype.name == "uint8" and s.segments.dtype.name == "uint16"
        assert (s.loss_mask[s.segments == 0] == 0).all()


def test_pack_never_splits_fitting_documents():
    import random

    rng = random.Random(0)
    docs, start = [], 1
    for _ in range(200):
        n = rng.randint(1, 16)
        docs.append(doc(n, start))
        start += n
    seqs = list(pack(docs, seq_len=16, pad_id=-1))
    rebuilt = []
    for s in seqs:
        for k in range(1, int(s.segments.max()) + 1):
            rebuilt.append(s.tokens[s.segments == k].tolist())
    assert rebuilt == [d.ids for d in docs]  # every document intact, in order, in one sequence


def test_pack_cuts_a_long_document_into_pieces():
    # The 11-token document starts a new sequence, fills two, and its 3-token tail opens a third,
    # which the next (1-token) document may join; the 2-token one after it does not fit.
    seqs = list(pack([doc(3, 100), doc(11, 1), doc(1, 50), doc(2, 60)], seq_len=4, pad_id=0))
    assert [s.tokens.tolist() for s in seqs] == [
        [100, 101, 102, 0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 50], [60, 61, 0, 0],
    ]
    assert [s.segments.tolist() for s in seqs[1:4]] == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 2]]


def test_pack_keeps_loss_mask_and_rejects_mismatch():
    (s,) = pack([doc(3, mask=[0, 1, 1]), doc(2, mask=[0, 0])], seq_len=6, pad_id=9)
    assert s.loss_mask.tolist() == [0, 1, 1, 0, 0, 0]
    assert s.tokens.tolist()[-1] == 9
    with pytest.raises(DataError, match="loss-mask"):
        list(pack([Doc([1, 2], [1])], seq_len=4, pad_id=0))


# ---------------------------------------------------------------- helpers


def test_position_ids_restart_per_document():
    seg = torch.tensor([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    assert position_ids(seg).tolist() == [[0, 1, 2, 0, 1, 0, 0, 0], list(range(8))]


def test_target_mask_hand_made():
    seg = torch.tensor([[1, 1, 1, 2, 2, 2, 0, 0]])
    loss = torch.tensor([[1, 0, 1, 1, 1, 1, 0, 0]])
    # t=0 -> token 1 has loss 0; t=1 -> token 2 ok; t=2 -> token 3 is another document;
    # t=3, 4 -> tokens 4, 5 ok; t=5 -> padding; t=6 padding; last position always False.
    assert target_mask(seg, loss).tolist() == [[False, True, False, True, True, False, False, False]]
    assert not target_mask(torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4))[0, -1]


def test_block_causal_mask_entries():
    seg = torch.tensor([[1, 1, 2, 2, 0]])
    m = block_causal_mask(seg, torch.float32)
    assert m.shape == (1, 1, 5, 5)
    allowed = (m[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],  # document 2 never sees document 1
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],  # padding sees itself only
    ]
    assert (m[0, 0][m[0, 0] != 0] == torch.finfo(torch.float32).min).all()
    assert block_causal_mask(seg, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llama_packed_logits_equal_documents_alone(attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = attn
    model = LlamaForCausalLM(cfg).eval()
    d1, d2 = torch.randint(1, 64, (7,)).tolist(), torch.randint(1, 64, (9,)).tolist()
    (s,) = pack([Doc(d1, [1] * 7), Doc(d2, [1] * 9)], seq_len=20, pad_id=0)
    tokens, _, seg = to_batch([s])
    with torch.no_grad():
        packed = model(tokens, attention_mask=block_causal_mask(seg, torch.float32), position_ids=position_ids(seg)).logits
        alone1 = model(torch.tensor([d1])).logits
        alone2 = model(torch.tensor([d2])).logits
        plain = model(tokens).logits  # ordinary causal attention lets document 2 see document 1
    assert_close(packed[:, :7], alone1, atol=1e-5, rtol=1e-5)
    assert_close(packed[:, 7:16], alone2, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(packed).all()
    assert (plain[:, 7:16] - alone2).abs().max() > 1e-3
