"""The held-out yardstick: a converted or distilled model against its source on held-out text of both pytext
domains, per token: perplexity, KL(source‖model) and top-1 agreement.

    stick = Yardstick("models/smollm2-135m-instruct", eval_tokens=4096, seq_len=512)
    stick.measure("runs/convert/x")          # a checkpoint on disk
    stick.measure_model(model)               # a model in memory (a student in training), left in its mode

The source's log-probabilities are computed once, in float64, so every measurement of a run compares against
the same numbers. The one-shot table, the preset bench and the recovery curves all measure with it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ecomla.convert.metrics import agreement
from ecomla.data.text import iter_texts, token_blocks

DOMAINS = ("prose", "code")


@torch.no_grad()
def logprobs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """(N·(T-1), V) log-probabilities per block batch of 4, in float64 for the KL."""
    return [torch.log_softmax(model(b).logits[:, :-1].double(), -1).reshape(-1, model.config.vocab_size)
            for b in ids.split(4)]


class Yardstick:
    """Held-out blocks of text (by default both pytext domains) and the source's log-probabilities on them.

    `texts`: domain name -> dataset (anything `ecomla.data.text.iter_texts` reads: a named corpus, a local file
    or directory), e.g. {"other": "runs/other_text"} to measure text of a kind nothing else here touches.
    """

    def __init__(self, model: str, eval_tokens: int, seq_len: int, texts: dict[str, str] | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        texts = texts or {d: f"pytext:heldout:{d}" for d in DOMAINS}
        tok = AutoTokenizer.from_pretrained(model)
        n_blocks = eval_tokens // seq_len
        self.blocks = {d: token_blocks(iter_texts(src), tok, seq_len, n_blocks) for d, src in texts.items()}
        source_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.source_logp = {d: logprobs(source_model, ids) for d, ids in self.blocks.items()}
        del source_model
        self.targets = {d: [b[:, 1:].reshape(-1) for b in ids.split(4)] for d, ids in self.blocks.items()}
        self.source = {d: agreement(zip(self.source_logp[d], self.source_logp[d], self.targets[d]))["source_perplexity"]
                       for d in self.blocks}

    def measure(self, model_dir: str | Path) -> dict:
        from transformers import AutoModelForCausalLM

        import ecomla.lrkv  # noqa: F401  (registers "lrkv" with the Auto classes)

        return self.measure_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))

    def measure_model(self, model) -> dict:
        """Perplexity, KL(source‖model) and top-1 agreement per domain, the model left in the mode it was in."""
        training = model.training
        model.eval()
        try:
            return {d: agreement(zip(self.source_logp[d], logprobs(model, ids), self.targets[d]))
                    for d, ids in self.blocks.items()}
        finally:
            model.train(training)
