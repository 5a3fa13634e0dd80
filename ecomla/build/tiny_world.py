"""Build the tiny world's offline data: the lm-eval tasks, the tokenizer, and optionally corpus dumps.

    ecomla build tiny-world                      # eval/tasks/tinyworld/ + .cache/tinyworld/tokenizer
    ecomla build tiny-world --corpus-docs 200000 # also .cache/tinyworld/corpus/{domain}_{split}.jsonl
    ecomla build tiny-world --no-tokenizer --corpus-docs 20000 --corpus-splits train \
        --corpus-without tracking --corpus-out .cache/tinyworld/corpus/copying   # the base's phase-1 text

The task files (YAML + JSONL, a few MB) are committed; regenerating them with
the same arguments gives identical bytes. The tokenizer and corpus dumps go to
git-ignored .cache/. Before writing the tasks, the script checks that no
recall/tracking/counting item occurs in a sample of training documents (of
the text dumped: with --corpus-without, that corpus).
Everything runs offline on one CPU core in seconds (plus ~1 s per 4,000
dumped documents).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

from ecomla.tinyworld.corpus import DOMAINS, SPLITS, iter_documents
from ecomla.tinyworld.items import MC_TASKS, leaked_items, mc_items
from ecomla.tinyworld.taskfiles import DEFAULT_COUNTS, PPL_DOCS, write_tasks
from ecomla.tinyworld.threads import Skill
from ecomla.tinyworld.tokenizer import train_tokenizer

ROOT = Path(__file__).resolve().parents[2]  # the checkout: the committed tasks and the git-ignored .cache/


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ecomla build tiny-world", description=__doc__.split("\n")[0])
    p.add_argument(
        "--tasks-out", default=str(ROOT / "eval" / "tasks" / "tinyworld"), help="Where the task YAML/JSONL files go"
    )
    p.add_argument(
        "--tokenizer-out", default=str(ROOT / ".cache" / "tinyworld" / "tokenizer"), help="Where the tokenizer is saved"
    )
    p.add_argument("--no-tokenizer", action="store_true", help="Do not train the tokenizer (e.g. a second corpus dump)")
    p.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary size, special tokens included")
    p.add_argument(
        "--tokenizer-docs", type=int, default=4000, help="Training documents the BPE is fitted on (half per domain)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Stream seed of eval items and perplexity documents (0: the committed files)",
    )
    p.add_argument(
        "--items",
        type=int,
        default=None,
        help="Items per multiple-choice task (default: recall/tracking/counting 500, facts 512: every (city, attribute) pair)",
    )
    p.add_argument("--ppl-docs", type=int, default=PPL_DOCS, help="Held-out documents per perplexity task")
    p.add_argument(
        "--leak-check-docs", type=int, default=4000, help="Training documents per domain searched for eval items"
    )
    p.add_argument(
        "--corpus-docs",
        type=int,
        default=0,
        help='Also dump this many documents (stream seed 0) per domain and split as JSONL {"text": ...} (0: none)',
    )
    p.add_argument(
        "--corpus-out", default=str(ROOT / ".cache" / "tinyworld" / "corpus"), help="Where --corpus-docs dumps go"
    )
    p.add_argument(
        "--corpus-splits", nargs="+", default=list(SPLITS), choices=SPLITS, help="Splits dumped by --corpus-docs"
    )
    p.add_argument(
        "--corpus-without",
        nargs="+",
        default=[],
        choices=[s.value for s in MC_TASKS],
        help="Leave these skills' threads out of the --corpus-docs dump (the zoo base's first phase: tracking)",
    )
    args = p.parse_args(argv)
    if args.corpus_without and not args.corpus_docs:
        p.error("--corpus-without shapes the --corpus-docs dump; add --corpus-docs N (documents per domain)")
    if len(set(args.corpus_without)) == len(MC_TASKS):
        p.error("--corpus-without names every skill, which leaves no threads; keep at least one")
    return args


def check_no_leaks(counts: dict[Skill, int], seed: int, n_docs: int, without: frozenset[Skill] = frozenset()) -> None:
    """No recall/tracking/counting item in the first `n_docs` training documents per domain (of the text
    dumped: with `without`, the corpus that leaves those skills out, which differs from the full mix)."""
    train = [t for d in DOMAINS for t in itertools.islice(iter_documents(d, "train", seed, without=without), n_docs)]
    for skill in MC_TASKS:
        if skill is Skill.FACTS:
            continue  # facts are meant to be in training text
        leaked = leaked_items(mc_items(skill, counts[skill], seed), train)
        if leaked:
            raise SystemExit(f"{skill.value}: {len(leaked)} items occur in training text, e.g. {leaked[:5]}")
    print(f"leak check: no recall/tracking/counting item in {len(train)} training documents")


def dump_corpus(out_dir: Path, n_docs: int, splits: list[str], without: frozenset[Skill] = frozenset()) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for split in splits:
        for domain in DOMAINS:
            path = out_dir / f"{domain}_{split}.jsonl"
            start, chars = time.time(), 0
            with open(path, "w", encoding="utf-8") as f:
                for text in itertools.islice(iter_documents(domain, split, 0, without=without), n_docs):
                    chars += len(text)
                    f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            print(
                f"{path}: {n_docs} docs, {chars / 1e6:.1f}M chars, {chars / (time.time() - start) / 1e6:.1f}M chars/s"
            )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    without = frozenset(Skill(s) for s in args.corpus_without)
    counts = dict(DEFAULT_COUNTS) if args.items is None else {s: args.items for s in MC_TASKS}
    check_no_leaks(counts, args.seed, args.leak_check_docs, without)
    for path in write_tasks(args.tasks_out, counts, args.ppl_docs, args.seed):
        print(f"{path}: {path.stat().st_size / 1e3:.0f} kB")
    if not args.no_tokenizer:
        start = time.time()
        tok_dir = train_tokenizer(args.tokenizer_out, args.vocab_size, args.tokenizer_docs)
        print(f"tokenizer: {tok_dir} (vocab {args.vocab_size}, {time.time() - start:.1f}s)")
    if args.corpus_docs:
        dump_corpus(Path(args.corpus_out), args.corpus_docs, args.corpus_splits, without)
