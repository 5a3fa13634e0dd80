"""Build the Python-text lm-eval tasks from the installed Python's held-out split.

    ecomla build pytext-tasks            # writes eval/tasks/pytext/ (about 3 s)
    ecomla build pytext-tasks --check    # rebuild in memory and compare with the committed files
    ecomla build pytext-tasks --stats models/smollm2-135m-instruct   # documents and tokens per split

The task files are committed, built on Python 3.11 (ecomla.pytext.corpus.BUILT_ON); the same Python gives
identical bytes. Another Python version carries other text under some document names, so the script refuses
to overwrite the committed files from one unless --any-python is given.
"""

from __future__ import annotations

import argparse
import filecmp
import tempfile
from pathlib import Path

from ecomla.pytext.corpus import BUILT_ON, python_version
from ecomla.pytext.tasks import ITEMS, PPL_PASSAGES, write_tasks

ROOT = Path(__file__).resolve().parents[2]  # the checkout


def print_stats(tokenizer_dir: str, tasks_dir: Path) -> int:
    import json

    from transformers import AutoTokenizer

    from ecomla.pytext.corpus import DOMAINS, SPLITS, documents

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    print(f"Python {'.'.join(map(str, python_version()))}; tokens by {tokenizer_dir}")
    print("| domain | split | documents | characters | tokens |\n|---|---|---|---|---|")
    for domain in DOMAINS:
        for split in SPLITS:
            docs = documents(domain, split)
            n = sum(len(tok(d.text, add_special_tokens=False)["input_ids"]) for d in docs)
            print(f"| {domain} | {split} | {len(docs):,} | {sum(len(d.text) for d in docs):,} | {n:,} |")
    print("\n| task | items | tokens (context + all choices, as lm-eval scores them) |\n|---|---|---|")
    for path in sorted(tasks_dir.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        texts = [r["text"] for r in rows] if "text" in rows[0] else [r["context"] + c for r in rows for c in r["choices"]]
        n = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
        print(f"| {path.stem} | {len(rows)} | {n:,} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ecomla build pytext-tasks", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "eval" / "tasks" / "pytext"), help="where the task files go")
    p.add_argument("--items", type=int, default=ITEMS, help="items per multiple-choice task")
    p.add_argument("--passages", type=int, default=PPL_PASSAGES, help="passages per perplexity task")
    p.add_argument("--check", action="store_true", help="compare a fresh build with the files in --out; write nothing")
    p.add_argument("--any-python", action="store_true", help=f"build even on a Python other than {BUILT_ON}")
    p.add_argument("--stats", metavar="TOKENIZER", help="print documents, characters and tokens (with this "
                   "tokenizer directory) per domain and split, and the task files' sizes; write nothing")
    args = p.parse_args(argv)
    if args.stats:
        return print_stats(args.stats, Path(args.out))
    if python_version() != BUILT_ON and not args.any_python:
        p.error(f"this is Python {python_version()}, the committed tasks come from {BUILT_ON}; "
                "pass --any-python (and --out elsewhere) to build from this one")
    if not args.check:
        for path in write_tasks(args.out, args.items, args.passages):
            print(path)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = write_tasks(tmp, args.items, args.passages)
        differ = [f.name for f in fresh if not filecmp.cmp(f, Path(args.out) / f.name, shallow=False)]
    print("identical" if not differ else f"differ: {', '.join(differ)}")
    return 1 if differ else 0
