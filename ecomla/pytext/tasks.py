"""lm-eval tasks built from the held-out split of the Python-text corpus.

    ecomla build pytext-tasks      # writes eval/tasks/pytext/

Tasks (all tagged `pytext`; chance is 25% on both multiple-choice tasks):

    pytext_prose_next   which of 4 sentences comes next after a passage of the language reference;
                        the 3 distractors are real sentences of similar length from other held-out topics
    pytext_code_next    which of 4 lines comes next in a real stdlib function; the 3 distractors are real
                        lines of similar length from other held-out files, re-indented like the true line
    pytext_ppl_prose,   perplexity (loglikelihood_rolling) on passages of held-out text,
    pytext_ppl_code     cut at blank lines, spread evenly over the split

and the group `pytext_mc`, the mean acc / acc_norm of the two multiple-choice
tasks. Every item comes from `pytext:heldout`, so no distillation or
calibration text (the other splits) contains it. The output is a pure
function of the installed Python's text and the seed.

Items are short on purpose: a 135M model scores about 400 tokens/s on 2 CPU
cores, and lm-eval runs context + choice once per choice.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass
from pathlib import Path

from ecomla.data.taskfiles import header, write_group, write_mc, write_ppl
from ecomla.pytext.corpus import Document, documents

TAG = "pytext"
GROUP = "pytext_mc"
LOADER = "pytext_data.load"  # eval/tasks/pytext/pytext_data.py
PROSE_NEXT, CODE_NEXT = "pytext_prose_next", "pytext_code_next"
MC_TASKS = (PROSE_NEXT, CODE_NEXT)
PPL_TASKS = {"prose": "pytext_ppl_prose", "code": "pytext_ppl_code"}
ITEMS = 500  # per multiple-choice task
PPL_PASSAGES = 40  # per domain
PASSAGE_CHARS = 1600  # at most, per perplexity passage (about 400 tokens)
CONTEXT_CHARS = 240  # at most, per multiple-choice context
VERSION = "1.0"  # bump whenever the generated items change

_HEADER = header("ecomla build pytext-tasks", "ecomla/pytext/tasks.py")
_ABOUT = {
    PROSE_NEXT: "Next sentence of held-out Python language-reference prose; distractors are sentences of similar "
    "length from other held-out topics.",
    CODE_NEXT: "Next line of a held-out stdlib function; distractors are lines of similar length from other "
    "held-out files, indented like the true line.",
}


@dataclass(frozen=True)
class Candidate:
    """A piece of text that can be a right answer (with its context) or a distractor elsewhere."""

    source: str  # the document it comes from
    context: str
    text: str  # the sentence, or the line without its indentation
    indent: str = ""


# ---- prose ------------------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")
_HEADING = re.compile(r"^[*=\-~^]{3,}$")
_LIST_MARK = re.compile(r"^(\d+\.|\*|-)\s+")  # "1. ", "* ": list items read as plain paragraphs


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs: blocks between blank lines that are not code, grammar or headings, lines joined."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if not block.strip() or lines[0].startswith(" ") or any(_HEADING.match(ln.strip()) for ln in lines):
            continue
        out.append(_LIST_MARK.sub("", " ".join(ln.strip() for ln in lines)))
    return out


def prose_candidates(docs: list[Document]) -> list[Candidate]:
    """Every sentence (30-240 chars) with at least one sentence of its topic before it, and that text as context."""
    out = []
    for doc in docs:
        previous = ""
        for para in _paragraphs(doc.text):
            sentences = _SENTENCE_END.split(para)
            for i in range(0 if previous else 1, len(sentences)):
                gold = sentences[i]
                if not 30 <= len(gold) <= 240:
                    continue
                before = " ".join(sentences[:i])
                if len(before) < 120 and previous:
                    before = previous + "\n\n" + before
                out.append(Candidate(doc.name, _tail(before, CONTEXT_CHARS, " "), gold))
            previous = para
    return out


def _tail(text: str, limit: int, sep: str) -> str:
    """The end of `text`, at most `limit` chars, cut after a separator so no word is split."""
    if len(text) <= limit:
        return text
    cut = text[-limit:]
    return cut[cut.find(sep) + 1:] if sep in cut else cut


# ---- code -------------------------------------------------------------------------------------------------

_TRIVIAL = re.compile(r"^(return|pass|else:|try:|finally:|break|continue|raise$|\)|\]|\}|#|@|\"\"\"|''')")


def code_candidates(docs: list[Document]) -> list[Candidate]:
    """Statement lines (20-100 chars) inside stdlib functions, each after at least two lines of its function."""
    out = []
    for doc in docs:
        try:
            tree = ast.parse(doc.text)
        except SyntaxError:
            continue
        lines = doc.text.split("\n")
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            start = node.lineno - 1 if not node.decorator_list else node.decorator_list[0].lineno - 1
            for stmt in ast.walk(node):
                if not isinstance(stmt, ast.stmt) or stmt is node or stmt.lineno - 1 - start < 2:
                    continue
                line = lines[stmt.lineno - 1]
                text = line.strip()
                if not 20 <= len(text) <= 100 or _TRIVIAL.match(text) or stmt.end_lineno != stmt.lineno:
                    continue
                context = "\n".join(lines[start:stmt.lineno - 1]) + "\n"
                out.append(Candidate(doc.name, _tail(context, CONTEXT_CHARS, "\n"), text, line[: len(line) - len(line.lstrip())]))
    # ast.walk's order is by depth; order by place so the evenly spaced pick below spreads over files and lines
    return sorted(set(out), key=lambda c: (c.source, c.context.count("\n"), c.context, c.text))


# ---- items ------------------------------------------------------------------------------------------------


def _items(candidates: list[Candidate], n: int, seed: int, task: str) -> list[dict]:
    """n items, evenly spaced over the candidates; 3 distractors each from other documents, of similar length."""
    if len(candidates) < n:
        raise ValueError(f"{task}: only {len(candidates)} candidates in the held-out split, {n} items asked for")
    by_len = sorted(range(len(candidates)), key=lambda i: len(candidates[i].text))
    rank = {idx: r for r, idx in enumerate(by_len)}
    items = []
    for k in range(n):
        idx = k * len(candidates) // n
        gold, r = candidates[idx], rank[idx]
        rng = random.Random(f"{task}/{seed}/{k}")
        # neighbours in length, from other documents, with text unlike the gold's
        window = [candidates[i] for i in by_len[max(0, r - 60): r + 60]]
        pool = sorted({c.text for c in window if c.source != gold.source and c.text != gold.text})
        picks = rng.sample(pool, 3)
        choices = [gold.indent + gold.text] + [gold.indent + t for t in picks]
        order = list(range(4))
        rng.shuffle(order)
        items.append({
            "id": f"{task}-{k:04d}",
            "source": gold.source,
            "context": gold.context,
            "choices": [choices[i] for i in order],
            "gold": order.index(0),
        })
    return items


def _unseen(candidates: list[Candidate], domain: str) -> list[Candidate]:
    """The candidates whose right answer, after the end of its context, is in no calibration or train document.

    Documents never share a split, but the stdlib repeats itself (vendored copies, near-identical helpers), so
    the pair (last line of context, answer) is looked up in the other splits' text as well.
    """
    seen = set()
    for split in ("calibration", "train"):
        for doc in documents(domain, split):
            lines = [ln.strip() for ln in doc.text.split("\n")] if domain == "code" else \
                [s for p in _paragraphs(doc.text) for s in _SENTENCE_END.split(p)]
            seen.update(zip(lines, lines[1:]))
    if domain == "code":
        return [c for c in candidates if (c.context.rstrip("\n").split("\n")[-1].strip(), c.text) not in seen]
    return [c for c in candidates if (_SENTENCE_END.split(c.context.split("\n\n")[-1])[-1], c.text) not in seen]


def prose_items(n: int = ITEMS, seed: int = 0) -> list[dict]:
    return _items(_unseen(prose_candidates(documents("prose", "heldout")), "prose"), n, seed, PROSE_NEXT)


def code_items(n: int = ITEMS, seed: int = 0) -> list[dict]:
    return _items(_unseen(code_candidates(documents("code", "heldout")), "code"), n, seed, CODE_NEXT)


def perplexity_passages(domain: str, n: int = PPL_PASSAGES) -> list[str]:
    """n passages of at most PASSAGE_CHARS, cut at blank lines, spread evenly over the held-out split."""
    passages = []
    for doc in documents(domain, "heldout"):
        current = ""
        for block in re.split(r"(?<=\n)\s*\n", doc.text):
            if current and len(current) + len(block) + 1 > PASSAGE_CHARS:
                passages.append(current)
                current = ""
            if len(block) <= PASSAGE_CHARS:
                current = f"{current}\n{block}" if current else block
        if current:
            passages.append(current)
    passages = [p for p in passages if len(p) >= PASSAGE_CHARS // 2]
    if len(passages) < n:
        raise ValueError(f"{domain}: only {len(passages)} held-out passages, {n} asked for")
    return [passages[k * len(passages) // n] for k in range(n)]


def write_tasks(out_dir: str | Path, n_items: int = ITEMS, n_passages: int = PPL_PASSAGES, seed: int = 0) -> list[Path]:
    """Write every task's YAML and JSONL and the group YAML into `out_dir`; return the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    common = {"head": _HEADER, "tag": TAG, "loader": LOADER, "version": VERSION}
    written = write_mc(out, PROSE_NEXT, prose_items(n_items, seed), about=_ABOUT[PROSE_NEXT], **common)
    written += write_mc(out, CODE_NEXT, code_items(n_items, seed), about=_ABOUT[CODE_NEXT], delimiter='""',
                        **common)
    for domain, name in PPL_TASKS.items():
        rows = [{"id": f"{domain}-{i:04d}", "text": t} for i, t in enumerate(perplexity_passages(domain, n_passages))]
        about = f"Perplexity on {n_passages} passages of held-out Python {domain} (at most {PASSAGE_CHARS} chars each)."
        written += write_ppl(out, name, rows, about=about, **common)
    about = "Mean accuracy of the two Python-text multiple-choice tasks (unweighted by size)."
    written.append(write_group(out, GROUP, list(MC_TASKS), head=_HEADER, about=about, version=VERSION))
    return written
