"""A small byte-level BPE tokenizer for the tiny world, saved as a Hugging Face fast tokenizer.

    from ecomla.tinyworld.tokenizer import train_tokenizer
    train_tokenizer(".cache/tinyworld/tokenizer")          # ~2-4 s on one core
    AutoTokenizer.from_pretrained(".cache/tinyworld/tokenizer")

Byte-level (GPT-2 style) so every string round-trips, trained on training
documents of both domains so neither is out-of-vocabulary for the other.
`<|endoftext|>` is BOS and EOS (it also separates packed documents), `<|pad|>`
pads. The chat template writes each message as `<|role|>content<|endoftext|>`
and ends a generation prompt with `<|assistant|>`; the role tokens are special,
so rendering more messages only appends tokens (prefix-stable, which
`ecomla.data.packing.chat_documents` needs to mask prompts).
"""

from __future__ import annotations

import itertools
from pathlib import Path

from ecomla.tinyworld.corpus import DOMAINS, iter_documents

EOS = "<|endoftext|>"
PAD = "<|pad|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = (EOS, PAD, *(f"<|{role}|>" for role in ROLES))  # ids 0..4, in this order

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('tinyworld chat roles are system, user and assistant, not ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|endoftext|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def train_tokenizer(out_dir: str | Path, vocab_size: int = 2048, num_docs: int = 4000, seed: int = 0) -> Path:
    """Train the BPE on `num_docs` training documents (half per domain) and save it to `out_dir`.

    Returns `out_dir`. The result depends only on the arguments (training on a
    fixed document order is deterministic).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (bytes + special tokens), got {vocab_size}"
        )
    per_domain = max(1, num_docs // len(DOMAINS))
    texts = [text for domain in DOMAINS for text in itertools.islice(iter_documents(domain, "train", seed), per_domain)]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,  # decode must give back the exact text
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out
