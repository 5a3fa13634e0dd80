"""Writes the tiny world's lm-eval tasks: one YAML and one JSONL per task, plus a group.

    ecomla build tiny-world       # writes eval/tasks/tinyworld/

Tasks (all tagged `tinyworld`, so `--tasks tinyworld` runs them all):

    tinyworld_recall, tinyworld_tracking,          multiple_choice, acc / acc_norm
    tinyworld_facts, tinyworld_counting
    tinyworld_ppl_stories, tinyworld_ppl_records   loglikelihood_rolling, word/byte perplexity, bits per byte

and the group `tinyworld_mc`, the mean acc / acc_norm of the four
multiple-choice tasks. The YAMLs hold no paths: each names its JSONL file,
which `tinyworld_data.load` (next to them; written by hand, not generated)
resolves against its own directory, so the tasks load from any working
directory. The output is a pure function of the counts and the seed.
"""

from __future__ import annotations

from pathlib import Path

from ecomla.data.taskfiles import header, write_group, write_mc, write_ppl
from ecomla.tinyworld.corpus import DOMAINS
from ecomla.tinyworld.items import MC_TASKS, mc_items, perplexity_documents
from ecomla.tinyworld.threads import Skill

TAG = "tinyworld"
GROUP = "tinyworld_mc"
LOADER = "tinyworld_data.load"  # eval/tasks/tinyworld/tinyworld_data.py
DEFAULT_COUNTS = {Skill.RECALL: 500, Skill.TRACKING: 500, Skill.COUNTING: 500, Skill.FACTS: 512}
PPL_DOCS = 500

_HEADER = header("ecomla build tiny-world", "ecomla/tinyworld/taskfiles.py")
_ABOUT = {
    Skill.RECALL: "In-context key -> value recall: a held-out document cut before a value; "
    "distractors are other values it states.",
    Skill.TRACKING: "Entity/state tracking: where a thing is, or who holds it, after several moves; "
    "distractors are earlier states.",
    Skill.FACTS: "Memorized world facts (a city's country, river, founder, trade) asked with no context.",
    Skill.COUNTING: "Counting: a running total after adds/removes, or how often something was seen; "
    "distractors are near misses.",
}

# The tasks' version (lm-eval metadata, shown in reports): bump it whenever the generated items change.
# 2.0: tracking moves no longer name the old place; counting is tallies of mentions (no arithmetic).
# 3.0: each tracking move ends with where the thing is now, worded as its thread's question.
VERSION = "3.0"

def mc_task_name(skill: Skill) -> str:
    return f"{TAG}_{skill.value}"


def ppl_task_name(domain: str) -> str:
    return f"{TAG}_ppl_{domain}"


def task_names() -> list[str]:
    """Every task the generator writes (not the group)."""
    return [mc_task_name(s) for s in MC_TASKS] + [ppl_task_name(d) for d in DOMAINS]


def write_tasks(
    out_dir: str | Path, counts: dict[Skill, int] | None = None, ppl_docs: int = PPL_DOCS, seed: int = 0
) -> list[Path]:
    """Write every task's YAML and JSONL and the group YAML into `out_dir`; return the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    counts = {**DEFAULT_COUNTS, **(counts or {})}
    written: list[Path] = []
    common = {"head": _HEADER, "tag": TAG, "loader": LOADER, "version": VERSION}
    for skill in MC_TASKS:
        rows = [it.to_json() for it in mc_items(skill, counts[skill], seed)]
        written += write_mc(out, mc_task_name(skill), rows, about=_ABOUT[skill], **common)
    for domain in DOMAINS:
        docs = perplexity_documents(domain, ppl_docs, seed)
        rows = [{"id": f"{domain}-{i:04d}", "text": t} for i, t in enumerate(docs)]
        about = f"Perplexity on {ppl_docs} held-out `{domain}` documents of the tiny world."
        written += write_ppl(out, ppl_task_name(domain), rows, about=about, **common)
    about = "Mean accuracy of the tiny world's four multiple-choice tasks (unweighted by size)."
    written.append(write_group(out, GROUP, [mc_task_name(s) for s in MC_TASKS], head=_HEADER, about=about,
                               version=VERSION))
    return written
