"""lm-eval's HFLM with each multiple-choice item's context run once, not once per choice.

lm-eval scores a multiple-choice item as one loglikelihood request per choice, each the whole context plus
that choice, so a 4-choice item runs its context 4 times. `SharedContextLM` groups the requests that share
a context (the choices of one item), runs the context once into the model's KV cache, and runs all the
choices together on copies of that cache. The numbers are HFLM's (the same log-probabilities of the
same tokens, to float rounding: `tests/eval/test_shared_context.py` compares the two request by request);
only the work changes. Requests without a shared context of at least two tokens (perplexity windows,
whose first windows share only the one prefix token; single-choice items), and models whose cache cannot be
copied across a batch, go through HFLM unchanged.

`ecomla eval` uses it when the recipe says `share_context: true` (off by default: on 2 CPU cores it saved only
2-14% of the pytext suite, docs/evaluate.md; batching several items' choices together is the next step).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from tqdm.auto import tqdm

Request = tuple[tuple[str, str], list[int], list[int]]


class SharedContextLM(HFLM):
    """HFLM whose loglikelihood requests that share a context run that context once (see the module doc)."""

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, (_, context, continuation) in enumerate(requests):
            if self.backend == "causal" and len(context) > 1 and len(context) + len(continuation) <= self.max_length + 1:
                groups[tuple(context)].append(i)
        shared = [members for members in groups.values() if len(members) > 1]
        in_shared = {i for members in shared for i in members}
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        rest = [i for i in range(len(requests)) if i not in in_shared]
        if rest:
            answers = super()._loglikelihood_tokens([requests[i] for i in rest], disable_tqdm, override_bs)
            for i, answer in zip(rest, answers):
                results[i] = answer
        for members in tqdm(shared, desc="Running loglikelihood requests (shared contexts)",
                            disable=disable_tqdm or self.rank != 0):
            group = [requests[i] for i in members]
            answers = self._shared_group(group)
            if answers is None:  # the model's cache cannot be repeated across a batch: plain HFLM for this group
                answers = super()._loglikelihood_tokens(group, True, override_bs)
            else:
                for request, answer in zip(group, answers):
                    if request[0] is not None:  # as HFLM: requests without a key are not cached
                        self.cache_hook.add_partial("loglikelihood", request[0], answer)
            for i, answer in zip(members, answers):
                results[i] = answer
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _shared_group(self, group: list[Request]) -> list[tuple[float, bool]] | None:
        """One item's choices (a context of at least two tokens): the context but its last token into the cache
        once, then every choice's tokens (the context's last token, then the choice but its last token) as one
        batch on copies of it. Position t of a row predicts the choice's token t, as in HFLM's
        `(context + choice)[:-1]`; the autocast and softmax dtype are HFLM's."""
        context = group[0][1]
        conts = [continuation for _, _, continuation in group]
        mixed = self.mixed_precision_dtype
        with torch.autocast(device_type=self.device.type, dtype=mixed, enabled=mixed is not None):
            prefix = torch.tensor([context[:-1]], dtype=torch.long, device=self.device)
            cache = self.model.get_decoder()(prefix, use_cache=True).past_key_values  # no logits needed here
            if not hasattr(cache, "batch_repeat_interleave"):
                return None
            cache.batch_repeat_interleave(len(conts))
            width = max(len(c) for c in conts)
            rows = torch.zeros(len(conts), width, dtype=torch.long, device=self.device)
            for j, c in enumerate(conts):  # right-padded: a causal row never reads its padding
                rows[j, : len(c)] = torch.tensor([context[-1]] + c[:-1], dtype=torch.long)
            logits = self.model(rows, past_key_values=cache, use_cache=True).logits
        logp = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
        answers = []
        for j, c in enumerate(conts):
            target = torch.tensor(c, dtype=torch.long, device=self.device)
            rows_logp = logp[j, : len(c)]
            answers.append((float(rows_logp.gather(-1, target[:, None]).sum()),
                            bool((rows_logp.argmax(-1) == target).all())))
        return answers
