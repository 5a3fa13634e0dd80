"""lm-eval's HFLM with each multiple-choice item's context run once, not once per choice.

lm-eval scores a multiple-choice item as one loglikelihood request per choice, each the whole context plus
that choice, so a 4-choice item runs its context 4 times. `SharedContextLM` groups the requests that share
a context (the choices of one item), runs the context once into the model's KV cache, and runs all the
choices together on copies of that cache. Several items go in one batch: their contexts (but the last
tokens) left-padded into one prefix pass (masked, with each row's own positions), then every choice of every
item, right-padded, as one batch on the copy of its item's cache, up to `batch_size` choices a batch (at least one item; one item a batch
under `batch_size: auto`). The numbers are HFLM's (the same log-probabilities of the same tokens, to float
rounding: `tests/eval/test_shared_context.py` compares the two request by request); only the work changes.
Requests without a shared context of at least two tokens (perplexity windows, whose first windows share only
the one prefix token; single-choice items), and models that return no cache, go through HFLM unchanged. Models
whose cache is not plain keys and values (recurrent or linear-attention layers) and fp16 models run one item
a batch (no padding in the context pass).

`ecomla eval` uses it when the recipe says `share_context: true` (off by default; its savings on 2 CPU cores:
docs/evaluate.md).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from tqdm.auto import tqdm
from transformers.cache_utils import DynamicLayer

Request = tuple[tuple[str, str], list[int], list[int]]
Answer = tuple[float, bool]


def batches(groups: list[list[int]], width: int) -> list[list[list[int]]]:
    """Consecutive groups, as many a batch as keep its members (choices) within `width` (at least one group)."""
    out: list[list[list[int]]] = []
    rows = 0
    for members in groups:
        if out and rows + len(members) <= width:
            out[-1].append(members)
            rows += len(members)
        else:
            out.append([members])
            rows = len(members)
    return out


class SharedContextLM(HFLM):
    """HFLM whose loglikelihood requests that share a context run that context once (see the module doc)."""

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[Answer]:
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, (_, context, continuation) in enumerate(requests):
            if self.backend == "causal" and len(context) > 1 and len(context) + len(continuation) <= self.max_length + 1:
                groups[tuple(context)].append(i)
        shared = [members for members in groups.values() if len(members) > 1]
        copies, pads = self._cache_support() if shared else (False, False)
        if not copies:  # no cache to copy across a batch: every request through HFLM
            shared = []
        in_shared = {i for members in shared for i in members}
        results: list[Answer | None] = [None] * len(requests)
        rest = [i for i in range(len(requests)) if i not in in_shared]
        if rest:
            answers = super()._loglikelihood_tokens([requests[i] for i in rest], disable_tqdm, override_bs)
            for i, answer in zip(rest, answers):
                results[i] = answer
        # Longest choice first, then longest context (HFLM also sorts longest first): a batch's rows pad little.
        shared.sort(key=lambda members: (-max(len(requests[i][2]) for i in members), -len(requests[members[0]][1])))
        size = override_bs or self.batch_size
        width = size if isinstance(size, int) and pads else 1
        bar = tqdm(total=len(shared), desc="Running loglikelihood requests (shared contexts)",
                   disable=disable_tqdm or self.rank != 0)
        for batch in batches(shared, width):
            items = [[requests[i] for i in members] for members in batch]
            answered = self._shared_batch(items)
            for group, answers in zip(items, answered):
                for request, answer in zip(group, answers):
                    if request[0] is not None:  # as HFLM: requests without a key are not cached
                        self.cache_hook.add_partial("loglikelihood", request[0], answer)
            for members, answers in zip(batch, answered):
                for i, answer in zip(members, answers):
                    results[i] = answer
            bar.update(len(batch))
        bar.close()
        return results  # type: ignore[return-value]

    def _cache_support(self) -> tuple[bool, bool]:
        """(copies, pads), probed once per model by a two-token pass: whether its cache can be copied across a
        batch (if not, shared contexts go through HFLM), and whether items may share a batch. Left padding is safe
        when every cache layer holds an attention layer's keys and values (a recurrent or linear-attention state
        would read the padding) and activations are not fp16 (whose eager additive mask can turn a fully padded
        query row into NaN, which then reaches the real rows through the cached values)."""
        if getattr(self, "_support", None) is None:
            with torch.no_grad():
                cache = self.model.get_decoder()(torch.ones(1, 2, dtype=torch.long, device=self.device),
                                                 use_cache=True).past_key_values
            copies = hasattr(cache, "batch_select_indices")
            layers = getattr(cache, "layers", None)
            fp16 = torch.float16 in (self.model.dtype, self.mixed_precision_dtype)
            self._support = (copies, copies and not fp16 and bool(layers)
                             and all(isinstance(layer, DynamicLayer) for layer in layers))
        return self._support

    @torch.no_grad()
    def _shared_batch(self, items: list[list[Request]]) -> list[list[Answer]]:
        """Items (each the requests of one context of at least two tokens) scored together. The contexts but
        their last tokens, left-padded, into the cache in one pass; then, on each item's copy of its cache row,
        every choice's tokens (the context's last token, then the choice but its last token), right-padded, as
        one batch. Position t of a row predicts the choice's token t, as in HFLM's `(context + choice)[:-1]`;
        each row's positions count from its own first token; the softmax skips the padding; the autocast and
        softmax dtype are HFLM's."""
        dev = self.device
        prefixes = [group[0][1][:-1] for group in items]
        conts = [(group[0][1][-1], continuation) for group in items for _, _, continuation in group]
        owner = torch.tensor([b for b, group in enumerate(items) for _ in group])  # CPU: indexes any cache device
        P, W = max(len(p) for p in prefixes), max(len(c) for _, c in conts)
        ids = torch.zeros(len(items), P, dtype=torch.long, device=dev)
        mask = torch.zeros(len(items), P, dtype=torch.long, device=dev)
        for b, p in enumerate(prefixes):  # left-padded: every prefix ends where its choices start
            ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, P - len(p):] = 1
        rows = torch.zeros(len(conts), W, dtype=torch.long, device=dev)
        row_mask = torch.zeros(len(conts), W, dtype=torch.long, device=dev)
        for j, (last, c) in enumerate(conts):  # right-padded: a causal row never reads its padding
            rows[j, : len(c)] = torch.tensor([last] + c[:-1], dtype=torch.long)
            row_mask[j, : len(c)] = 1
        lengths = mask.sum(-1)
        mixed = self.mixed_precision_dtype
        with torch.autocast(device_type=dev.type, dtype=mixed, enabled=mixed is not None):
            cache = self.model.get_decoder()(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                                             use_cache=True).past_key_values  # no logits needed here
            cache.batch_select_indices(owner)
            start = lengths[owner, None]  # padding stays at a real position: never past max_length, nor rescaling RoPE
            positions = torch.where(row_mask.bool(), start + torch.arange(W, device=dev)[None], start)
            logits = self.model(rows, attention_mask=torch.cat([mask[owner], row_mask], -1), position_ids=positions,
                                past_key_values=cache, use_cache=True).logits
        real = row_mask.bool()
        logp = F.log_softmax(logits[real], dim=-1, dtype=self.softmax_dtype).split(row_mask.sum(-1).tolist())
        answers: list[Answer] = []
        for j, (_, c) in enumerate(conts):
            target = torch.tensor(c, dtype=torch.long, device=dev)
            rows_logp = logp[j]
            answers.append((float(rows_logp.gather(-1, target[:, None]).sum()),
                            bool((rows_logp.argmax(-1) == target).all())))
        out, start = [], 0
        for group in items:
            out.append(answers[start: start + len(group)])
            start += len(group)
        return out
