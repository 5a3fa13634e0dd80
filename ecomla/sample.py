"""Text sampled from a model: distillation data that does not run out.

    ecomla sample MODEL OUT.jsonl --tokens N [--prompts DATASET] [--prompt-tokens 16] [--length 512] ...

A small corpus limits distillation: a run longer than the corpus repeats it. Text that the source model writes
itself is the usual way past that (the student then learns the source's distribution where the source puts its
mass). Each row starts from the first `prompt_tokens` tokens of a document of `prompts` (so the samples stay in
that text's domain; documents are cycled when more rows are needed than there are documents), or from the BOS
token alone, and continues with the model's own tokens, sampled at `temperature` (and `top_p`), up to `length`
tokens in all or the EOS token. Rows are `{"text": ...}` lines of a .jsonl file, which every `dataset` key of a
recipe reads (`data.train.dataset: OUT.jsonl`). The file is written under a temporary name and renamed into place
when complete, so an interrupted run leaves nothing that looks whole. One seed gives the same text on the same
machine and software.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from ecomla.errors import UserError


class SampleError(UserError, ValueError):
    """A sampling request that cannot run: bad settings, no prompts, or an output in the way."""


@dataclass(frozen=True)
class SampleSpec:
    """What `ecomla sample` writes: how many tokens, from which prompts, sampled how."""

    model: str
    out: str
    tokens: int
    prompts: str | None = None
    prompt_tokens: int = 16
    length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    batch_size: int = 8
    seed: int = 0
    device: str = "auto"

    def problems(self) -> list[str]:
        out = []
        if self.tokens < 1:
            out.append(f"--tokens: {self.tokens}; give the number of tokens to write (at least 1)")
        if not str(self.out).endswith(".jsonl"):
            out.append(f"{self.out}: the output is a .jsonl file (rows of {{\"text\": ...}}); name it OUT.jsonl")
        if self.prompts is not None and self.prompt_tokens < 1:
            out.append(f"--prompt-tokens: {self.prompt_tokens}; a prompt from --prompts needs at least 1 token")
        if self.length <= (self.prompt_tokens if self.prompts else 1):
            out.append(f"--length: {self.length} leaves no token to sample after a prompt of "
                       f"{self.prompt_tokens if self.prompts else 1}; give a longer --length")
        if not self.temperature > 0:
            out.append(f"--temperature: {self.temperature}; sampling needs a temperature above 0")
        if not 0 < self.top_p <= 1:
            out.append(f"--top-p: {self.top_p}; give a value in (0, 1]")
        if self.batch_size < 1:
            out.append(f"--batch-size: {self.batch_size}; give at least 1")
        if self.device not in ("auto", "cpu", "cuda"):
            out.append(f"--device: {self.device!r}; one of auto, cpu, cuda")
        return out


def _prompts(spec: SampleSpec, tokenizer) -> list[list[int]]:
    """The prompts' token ids: the first prompt_tokens tokens of each long-enough document, or BOS alone."""
    if spec.prompts is None:
        bos = tokenizer.bos_token_id
        if bos is None:
            raise SampleError(f"{spec.model}: its tokenizer has no BOS token to start from; give --prompts DATASET "
                              "(rows then start from the first --prompt-tokens tokens of its documents)")
        return [[bos]]
    from ecomla.data.text import iter_texts

    prompts = []
    for text in iter_texts(spec.prompts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= spec.prompt_tokens:
            prompts.append(ids[: spec.prompt_tokens])
    if not prompts:
        raise SampleError(f"--prompts {spec.prompts}: no document has {spec.prompt_tokens} tokens; give a smaller "
                          "--prompt-tokens or another dataset")
    return prompts


def sample_text(spec: SampleSpec, *, force: bool = False, progress: bool = True) -> Path:
    """Write spec.tokens tokens (at least) of text sampled from spec.model to spec.out; returns its path."""
    problems = spec.problems()
    out = Path(spec.out)
    if out.exists() and not force:
        problems.append(f"{out} exists; pass --force to replace it, or name another file")
    if problems:
        raise SampleError("; ".join(problems))

    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ecomla.io.checkpoint import resolve_model_dir
    from ecomla.io.publish import publish

    device = ("cuda" if torch.cuda.is_available() else "cpu") if spec.device == "auto" else spec.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SampleError("--device cuda: no CUDA device here; use --device cpu (or auto)")
    path = resolve_model_dir(spec.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = _prompts(spec, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    model.to(device).eval()
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    torch.manual_seed(spec.seed)

    tmp = out.with_name(f".{out.name}.tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    written, row = 0, 0
    bar = tqdm(total=spec.tokens, unit="tok", desc="sample", disable=not progress)
    try:
        with open(tmp, "w") as f, torch.inference_mode():
            while written < spec.tokens:
                # as many rows as the tokens still missing need, were none to stop early at EOS
                rows = min(spec.batch_size, math.ceil((spec.tokens - written) / spec.length))
                ids = torch.tensor([prompts[(row + i) % len(prompts)] for i in range(rows)], device=device)
                outs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                      temperature=spec.temperature, top_p=spec.top_p, top_k=0,
                                      max_new_tokens=spec.length - ids.shape[1], pad_token_id=pad, eos_token_id=eos)
                for seq in outs.tolist():
                    gen = seq[ids.shape[1]:]
                    if eos is not None and eos in gen:
                        gen = gen[: gen.index(eos)]
                    f.write(json.dumps({"text": tokenizer.decode(seq[: ids.shape[1]] + gen,
                                                                 skip_special_tokens=True)}) + "\n")
                    written += ids.shape[1] + len(gen)
                    bar.update(ids.shape[1] + len(gen))
                row += rows
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    publish(tmp, out)
    # what wrote it, beside it (a .yaml, which no dataset reader takes for data)
    record = {**asdict(spec), "rows": row, "tokens_written": written}
    out.with_name(f"{out.stem}.sample.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    return out
