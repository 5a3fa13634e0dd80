"""Training data of a run: a prepared shard directory or a dataset packed at start-up, plus `ecomla prepare-data`.

    ecomla prepare-data RECIPE.yaml [--force]

`prepare-data` tokenizes `data.train` (and `data.eval`) of a distill recipe once
and writes memory-mapped shards to `<output_dir>/data/{train,eval}`; point
`data.train.prepared` at them for billion-token runs. Small datasets can skip
it: the same packing runs in memory at start-up.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from ecomla.data.packing import Doc, block_causal_mask, chat_documents, pack, position_ids, target_mask, text_documents
from ecomla.data.shards import PackedDataset, ShardWriter, pack_to_memory
from ecomla.data.text import DataError, iter_rows, iter_texts, named_corpus
from ecomla.distill.recipe import DataSource, DistillRecipe


def documents(src: DataSource, tokenizer) -> Iterator[Doc]:
    """Tokenized documents of a text or chat source, in order, then those of each `mix` part."""
    for part in (src, *src.mix):
        docs = _source_documents(part, tokenizer)
        if part.document_tokens is not None:
            docs = (Doc(d.ids[:part.document_tokens], d.loss_mask[:part.document_tokens]) for d in docs)
        yield from _limited(docs, part.max_documents, part.max_tokens)


def _source_documents(src: DataSource, tokenizer) -> Iterator[Doc]:
    if src.format == "text":
        return text_documents(iter_texts(src.dataset, text_field=src.text_field, split=src.split, subset=src.subset),
                              tokenizer)
    rows = (row[src.messages_field] for row in iter_rows(src.dataset, split=src.split, subset=src.subset, field=src.messages_field))
    return chat_documents(rows, tokenizer)


def _limited(docs: Iterator[Doc], max_documents: int | None, max_tokens: int | None) -> Iterator[Doc]:
    left = max_tokens
    for n, doc in enumerate(docs):
        if (max_documents is not None and n >= max_documents) or (left is not None and left <= 0):
            return
        if left is not None:
            doc = Doc(doc.ids[:left], doc.loss_mask[:left])
            left -= len(doc.ids)
        yield doc


def pad_id(tokenizer) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def prepared_dir(output_dir: str, name: str) -> Path:
    """Where `ecomla prepare-data` writes split `name` of a recipe."""
    return Path(output_dir) / "data" / name


def source_meta(src: DataSource) -> dict:
    """What a prepared shard directory records of the source it packed (and compares before reuse)."""
    return {"source": src.dataset, "format": src.format, "max_documents": src.max_documents,
            "max_tokens": src.max_tokens, "document_tokens": src.document_tokens,
            "mix": [source_meta(p) for p in src.mix]}


def _matches(meta: dict, src: DataSource, seq_len: int) -> bool:
    want = {**source_meta(src), "seq_len": seq_len}
    defaults = {"max_tokens": None, "document_tokens": None, "mix": []}  # shards written before these keys existed
    return all(meta.get(k, defaults.get(k)) == v for k, v in want.items())


def open_dataset(src: DataSource, tokenizer, seq_len: int, what: str, output_dir: str | None = None):
    """A dataset with `len`, `batch(indices)` and `seq_len`; a clear error if it is missing or empty.

    A `dataset` source that `ecomla prepare-data` already packed into this run's
    output_dir is read from those shards instead of being tokenized again.
    """
    if src.prepared is None and output_dir is not None:
        shards = prepared_dir(output_dir, what.split(".")[-1])
        if (shards / "meta.json").is_file():
            ds = PackedDataset(shards)
            if _matches(ds.meta, src, seq_len):
                return ds
    if src.prepared is not None:
        ds = PackedDataset(src.prepared)
        if ds.seq_len != seq_len:
            raise DataError(f"{what}.prepared: {src.prepared} was packed at seq_len {ds.seq_len}, the recipe says {seq_len}")
        return ds
    if not Path(src.dataset).exists() and "/" not in src.dataset and named_corpus(src.dataset) is None:
        raise DataError(f"{what}.dataset: {src.dataset} does not exist")
    seqs = pack_to_memory(documents(src, tokenizer), seq_len, pad_id(tokenizer))
    if len(seqs) == 0:
        raise DataError(f"{what}.dataset: {src.dataset} yielded no tokens; check the file and its text field")
    return seqs


def model_inputs(batch: dict[str, torch.Tensor], cross_document: bool, dtype: torch.dtype, device) -> dict:
    """input_ids, position_ids, attention_mask (4D block-causal unless cross-document), and the target mask."""
    seg = batch["segments"]
    inputs = {"input_ids": batch["tokens"].to(device), "position_ids": position_ids(seg).to(device)}
    if not cross_document:
        inputs["attention_mask"] = block_causal_mask(seg, dtype).to(device)
    valid = target_mask(seg, batch["loss_mask"])
    return {"inputs": inputs, "valid": valid.to(device), "targets": batch["tokens"].roll(-1, dims=1).to(device)}


def prepare_data(recipe: DistillRecipe, tokenizer, force: bool = False) -> list[Path]:
    """Write memory-mapped shards for data.train and data.eval; returns their directories."""
    written = []
    for name, src in (("train", recipe.data.train), ("eval", recipe.data.eval)):
        if src is None or src.prepared is not None:
            continue
        out = prepared_dir(recipe.output_dir, name)
        meta = {**source_meta(src), "tokenizer": str(getattr(tokenizer, "name_or_path", "")), "vocab_size": len(tokenizer)}
        with ShardWriter(out, recipe.data.seq_len, meta=meta, overwrite=force) as writer:
            n = writer.write_all(pack(documents(src, tokenizer), recipe.data.seq_len, pad_id(tokenizer)))
            if n == 0:
                raise DataError(f"data.{name}.dataset: {src.dataset} yielded no tokens")
        written.append(out)
    return written
