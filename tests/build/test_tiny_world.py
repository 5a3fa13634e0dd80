"""`ecomla build tiny-world`: a rebuild of the tiny world's task files gives the committed bytes."""

from __future__ import annotations

import filecmp
from pathlib import Path

from ecomla.build.tiny_world import main

ROOT = Path(__file__).resolve().parents[2]


def test_a_rebuild_of_the_tasks_gives_the_committed_files(tmp_path, capsys):
    main(["--tasks-out", str(tmp_path / "tasks"), "--no-tokenizer"])
    committed = ROOT / "eval" / "tasks" / "tinyworld"
    names = sorted(p.name for p in (tmp_path / "tasks").iterdir())
    assert len(names) == 13  # every task's YAML and JSONL, and the group (tinyworld_data.py is hand-written)
    _, mismatch, errors = filecmp.cmpfiles(committed, tmp_path / "tasks", names, shallow=False)
    assert mismatch == [] and errors == []
    assert "kB" in capsys.readouterr().out
