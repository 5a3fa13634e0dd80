"""Documents -> fixed-length packed sequences that respect document boundaries.

A document is `Doc(ids, loss_mask)`: token ids and, per token, 1 when the token
is a target the model should learn to predict (0 for the prompt side of chat
data). `text_documents` and `chat_documents` make documents; `pack` places
whole documents into sequences of `seq_len` tokens and numbers them in
`segments` (0 = padding, 1..k = the documents of one sequence).

The torch helpers turn the segments of a micro-batch (B, T) into what the model
and the loss need, so documents sharing a sequence never see each other:

    position_ids(segments)            (B, T) long, restarting at 0 per document
    target_mask(segments, loss_mask)  (B, T) bool, True where tokens[t+1] is a target
    block_causal_mask(segments, dt)   (B, 1, T, T) additive mask for HF attention
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ecomla.data.text import DataError

_MAX_SEGMENTS = np.iinfo(np.uint16).max  # segments are stored as uint16


class Doc(NamedTuple):
    """One document: token ids and a 0/1 loss mask of the same length."""

    ids: list[int]
    loss_mask: list[int]  # 1 where the token is a target, 0 for prompt tokens


@dataclass
class PackedSequence:
    """One packed training sequence of T tokens."""

    tokens: np.ndarray  # (T,) int32 token ids; pad_id where segments == 0
    loss_mask: np.ndarray  # (T,) uint8, 1 where the token is a target
    segments: np.ndarray  # (T,) uint16, 0 = padding, 1..k = document number within the sequence


# ---------------------------------------------------------------- documents


def text_documents(texts: Iterable[str], tokenizer, *, batch_size: int = 1000) -> Iterator[Doc]:
    """Plain-text documents, every token a target, each ended by EOS when the tokenizer has one.

    Texts are tokenized `batch_size` at a time (fast tokenizers run batches in
    parallel) without special tokens; order is kept.
    """
    eos = tokenizer.eos_token_id
    tail = [] if eos is None else [eos]
    batch: list[str] = []

    def flush() -> Iterator[Doc]:
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            ids = list(ids) + tail
            yield Doc(ids, [1] * len(ids))
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) >= batch_size:
            yield from flush()
    if batch:
        yield from flush()


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def chat_documents(rows: Iterable[list[dict]], tokenizer) -> Iterator[Doc]:
    """Chat documents: assistant tokens are targets (loss 1), system/user/tool tokens are not.

    Each row is a `messages` list of {role, content}. Message k owns the tokens
    its rendering adds to the rendering of messages[:k]. For an assistant
    message, the header the template adds as its generation prompt (e.g.
    "<|assistant|>") is not a target; the content and its end token are. The
    template must be prefix-stable (rendering more messages only appends tokens).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            "the tokenizer has no chat template, so chat data cannot be rendered; set \"chat_template\" "
            "in the tokenizer's tokenizer_config.json (or use a tokenizer that ships one)"
        )
    for row_no, messages in enumerate(rows):
        if not isinstance(messages, list):
            raise DataError(f"chat row {row_no}: expected a list of {{role, content}} messages, got {type(messages).__name__}")
        ids: list[int] = []
        mask: list[int] = []
        for k, message in enumerate(messages):
            full = _render(tokenizer, messages[: k + 1])
            if full[: len(ids)] != ids:
                raise DataError(
                    f"chat row {row_no}: the chat template is not prefix-stable (rendering messages[:{k + 1}] "
                    f"changes the tokens of messages[:{k}]), so loss masks cannot be assigned per message; "
                    "use a template that only appends tokens per message"
                )
            start = len(ids)
            if message.get("role") == "assistant":
                # The generation prompt is the assistant header; where it stops matching, targets begin.
                prompt = _render(tokenizer, messages[:k], add_generation_prompt=True) if k else []
                header = max(start, _common_prefix(prompt, full))
                mask += [0] * (header - start) + [1] * (len(full) - header)
            else:
                mask += [0] * (len(full) - start)
            ids = full
        if ids:
            yield Doc(ids, mask)


# ---------------------------------------------------------------- packing


def pack(docs: Iterable[Doc], seq_len: int, pad_id: int) -> Iterator[PackedSequence]:
    """Greedy packing of whole documents into sequences of `seq_len` tokens.

    Documents go into the current sequence while they fit; a document that
    does not fit closes it (the rest is padding) and starts the next one.
    Documents are never split, except one longer than `seq_len`: it is cut
    into `seq_len`-token pieces, each starting a new sequence (positions
    restart in every piece, and the first token of a piece is not a target).
    Empty documents are skipped.
    """
    if seq_len < 2:
        raise DataError(f"seq_len must be at least 2, got {seq_len}")
    tokens: list[int] = []
    mask: list[int] = []
    segs: list[int] = []

    def close() -> PackedSequence:
        pad = seq_len - len(tokens)
        seq = PackedSequence(
            tokens=np.asarray(tokens + [pad_id] * pad, dtype=np.int32),
            loss_mask=np.asarray(mask + [0] * pad, dtype=np.uint8),
            segments=np.asarray(segs + [0] * pad, dtype=np.uint16),
        )
        tokens.clear()
        mask.clear()
        segs.clear()
        return seq

    for ids, loss in docs:
        if len(ids) != len(loss):
            raise DataError(f"a document has {len(ids)} tokens but {len(loss)} loss-mask entries; they must match")
        for start in range(0, len(ids), seq_len):  # one piece unless the document is longer than seq_len
            piece, piece_loss = ids[start : start + seq_len], loss[start : start + seq_len]
            segment = (segs[-1] if segs else 0) + 1
            if tokens and (len(tokens) + len(piece) > seq_len or segment > _MAX_SEGMENTS):
                yield close()
                segment = 1
            tokens.extend(piece)
            mask.extend(piece_loss)
            segs.extend([segment] * len(piece))
            if len(tokens) == seq_len:
                yield close()
    if tokens:
        yield close()


# ---------------------------------------------------------------- micro-batch helpers (torch)


def position_ids(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) long positions that restart at 0 at each document; padding gets 0."""
    seg = segments.long()
    B, T = seg.shape
    idx = torch.arange(T, device=seg.device).expand(B, T)  # (B, T)
    starts = torch.ones_like(seg, dtype=torch.bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    last_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # (B, T)
    return torch.where(seg == 0, torch.zeros_like(idx), idx - last_start)


def target_mask(segments: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: True at t when tokens[t+1] is a target of the same document.

    The logits at t predict tokens[t+1], so the loss is taken where
    segments[t] == segments[t+1] != 0 and loss_mask[t+1] == 1. The last
    position has no next token and is always False.
    """
    seg = segments.long()
    out = torch.zeros_like(seg, dtype=torch.bool)
    out[:, :-1] = (seg[:, :-1] == seg[:, 1:]) & (seg[:, 1:] != 0) & loss_mask[:, 1:].bool()
    return out


def block_causal_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, T, T) additive attention mask: 0 where query i may attend to key j, finfo.min elsewhere.

    Allowed: j <= i, same document, not padding. A padding query attends to
    itself only, so its softmax stays finite. Pass it as a 4D `attention_mask`
    to Hugging Face models together with `position_ids(segments)`.
    """
    seg = segments.long()
    T = seg.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=seg.device).tril()  # (T, T)
    same = seg[:, :, None] == seg[:, None, :]  # (B, T, T), query i x key j
    allowed = causal & same & (seg[:, None, :] != 0)
    eye = torch.eye(T, dtype=torch.bool, device=seg.device)
    allowed |= eye & (seg == 0)[:, :, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=seg.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]  # (B, 1, T, T)
