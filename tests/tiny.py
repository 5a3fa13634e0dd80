"""Builders for tiny, random, offline test fixtures: source checkpoints, a tokenizer, a two-domain corpus."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
)

_WORDS_A = "the cat sat on a mat and saw red blue green fish in one two three bowls".split()
_WORDS_B = "market prices rose sharply while bonds fell; analysts expect rates to remain high through winter".split()


def domain_text(domain: str, n_docs: int, seed: int) -> list[str]:
    """Documents of one domain: 'a' (tiny-vocabulary stories) or 'b' (finance-like prose)."""
    rng = random.Random(f"{domain}-{seed}")
    words = _WORDS_A if domain == "a" else _WORDS_B
    return [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) + "." for _ in range(n_docs)]


def write_corpus(directory: Path) -> Path:
    """directory/{a,b}_{fit,held}.jsonl; fit and held-out come from different seeds."""
    directory.mkdir(parents=True, exist_ok=True)
    for domain in ("a", "b"):
        for split, seed in (("fit", 1), ("held", 2)):
            with open(directory / f"{domain}_{split}.jsonl", "w") as f:
                for text in domain_text(domain, 300, seed):
                    f.write(json.dumps({"text": text}) + "\n")
    return directory


def make_tokenizer(directory: Path, vocab_size: int = 320) -> Path:
    """A byte-level BPE trained on both domains, saved as a Hugging Face fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(domain_text("a", 200, 0) + domain_text("b", 200, 0), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return directory


def make_source(out: Path, tokenizer_dir: Path, *, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random tiny Llama/Mistral/Qwen2 checkpoint with non-trivial norm gains and biases."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    kwargs = dict(TINY, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if family == "mistral":
        kwargs["sliding_window"] = None
    if family == "qwen2":
        kwargs["use_sliding_window"] = False
    kwargs.update(overrides)
    cfg = AutoConfig.for_model(family, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # gains away from 1, so folding them is tested
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
