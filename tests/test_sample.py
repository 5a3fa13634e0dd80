"""`ecomla sample`: text sampled from a model, as a dataset every recipe reads."""

from __future__ import annotations

import json

import pytest
import yaml
from transformers import AutoTokenizer

from ecomla.cli import main
from ecomla.data.text import iter_texts
from ecomla.sample import SampleError, SampleSpec, sample_text


def rows(path):
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_rows_start_from_the_prompts_and_reach_the_tokens(source_factory, corpus_dir, tmp_path):
    src = source_factory("llama")
    out = tmp_path / "s" / "sampled.jsonl"
    spec = SampleSpec(model=str(src), out=str(out), tokens=300, prompts=str(corpus_dir / "a_fit.jsonl"),
                      prompt_tokens=6, length=40, batch_size=3, device="cpu")
    assert sample_text(spec, progress=False) == out
    tok = AutoTokenizer.from_pretrained(src)
    docs = [tok(t, add_special_tokens=False)["input_ids"][:6] for t in iter_texts(str(corpus_dir / "a_fit.jsonl"))]
    texts = rows(out)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    # each row starts with its prompt document's first tokens, in order, and continues past them
    assert all(tok.decode(d) and t.startswith(tok.decode(d)) for d, t in zip(docs, texts))
    assert any(len(i) > 6 for i in ids)  # (a random model's bytes may re-tokenize to more tokens than it wrote)
    meta = yaml.safe_load((tmp_path / "s" / "sampled.sample.yaml").read_text())
    assert meta["tokens"] == 300 and 300 <= meta["tokens_written"] <= 40 * len(texts)
    assert meta["rows"] == len(texts) and meta["temperature"] == 1.0
    assert len(texts) < 300 // 40 + 3  # no more rows than the tokens need (EOS may end a few early)
    assert list(iter_texts(str(out))) == texts  # the dataset reader takes it as it is, and the .yaml is no data
    assert list(iter_texts(str(out.parent))) == texts
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary file left
    # one seed, one text; another seed, another text
    again = tmp_path / "again.jsonl"
    sample_text(SampleSpec(**{**spec.__dict__, "out": str(again)}), progress=False)
    assert rows(again) == texts
    other = tmp_path / "other.jsonl"
    sample_text(SampleSpec(**{**spec.__dict__, "out": str(other), "seed": 1}), progress=False)
    assert rows(other) != texts


def test_bad_requests_name_the_fix_and_write_nothing(source_factory, corpus_dir, tmp_path):
    src = source_factory("llama")
    out = tmp_path / "x.jsonl"
    bad = SampleSpec(model=str(src), out=str(tmp_path / "x.txt"), tokens=0, length=4, prompts="p", prompt_tokens=8,
                     temperature=0.0, top_p=1.5, batch_size=0, device="tpu")
    with pytest.raises(SampleError) as err:
        sample_text(bad, progress=False)
    for expected in ("--tokens: 0", "name it OUT.jsonl", "--length: 4 leaves no token", "--temperature: 0.0",
                     "--top-p: 1.5", "--batch-size: 0", "--device: 'tpu'"):
        assert expected in str(err.value), (expected, str(err.value))
    with pytest.raises(SampleError, match="no document has 100000 tokens; give a smaller --prompt-tokens"):
        sample_text(SampleSpec(model=str(src), out=str(out), tokens=10, prompts=str(corpus_dir / "a_fit.jsonl"),
                               prompt_tokens=100000, length=100001), progress=False)
    assert list(tmp_path.glob("*.jsonl")) == [] and list(tmp_path.glob(".*")) == []
    out.write_text("{}\n")
    with pytest.raises(SampleError, match="exists; pass --force"):
        sample_text(SampleSpec(model=str(src), out=str(out), tokens=10), progress=False)


def test_the_command_from_bos_and_as_training_data(source_factory, tmp_path, capsys):
    src = source_factory("llama")
    out = tmp_path / "bos.jsonl"
    assert main(["sample", str(src), str(out), "--tokens", "64", "--length", "16", "--batch-size", "2",
                 "--device", "cpu", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert len(rows(out)) >= 4
    assert main(["sample", str(src), str(out), "--tokens", "64", "--temperature", "0"]) == 2
    assert "--temperature: 0.0; sampling needs a temperature above 0" in capsys.readouterr().err
