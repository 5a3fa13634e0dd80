"""ecomla.io.publish: a finished output replaces the old one by renames, and nothing is left beside it."""

from __future__ import annotations

import pytest

from ecomla.io.publish import publish


def _tree(path, text):
    path.mkdir()
    (path / "a.txt").write_text(text)
    return path


def test_a_directory_replaces_the_old_one_and_leaves_nothing_beside_it(tmp_path):
    out = _tree(tmp_path / "out", "old")
    publish(_tree(tmp_path / ".out.tmp", "new"), out)
    assert (out / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_file_and_a_new_destination(tmp_path):
    (tmp_path / ".f.partial").write_text("x")
    publish(tmp_path / ".f.partial", tmp_path / "sub" / "f.gguf")
    assert (tmp_path / "sub" / "f.gguf").read_text() == "x"


def test_no_replace_keeps_both(tmp_path):
    out = _tree(tmp_path / "out", "old")
    tmp = _tree(tmp_path / ".out.tmp", "new")
    with pytest.raises(FileExistsError, match="nothing was replaced"):
        publish(tmp, out, replace=False)
    assert (out / "a.txt").read_text() == "old" and (tmp / "a.txt").read_text() == "new"
