"""`checkpoints/latest`: swapped in whole, and a resume refuses one that names no checkpoint instead of crashing."""

from __future__ import annotations

from pathlib import Path

import pytest

from ecomla.distill.trainer import TrainingError, read_latest, write_latest


def _checkpoint(ckpt: Path, step: int) -> str:
    tag = f"step_{step:08d}"
    (ckpt / tag).mkdir(parents=True)
    (ckpt / tag / "trainer_state.json").write_text("{}\n")
    return tag


def test_a_write_cut_before_the_rename_leaves_the_old_tag(tmp_path, monkeypatch):
    old, new = _checkpoint(tmp_path, 4), _checkpoint(tmp_path, 8)
    write_latest(tmp_path, old)

    def killed(self, target):  # the process dies between writing the new text and swapping it in
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_latest(tmp_path, new)
    monkeypatch.undo()
    assert read_latest(tmp_path) == old
    write_latest(tmp_path, new)
    assert read_latest(tmp_path) == new
    assert not (tmp_path / "latest.tmp").exists()


def test_no_latest_is_a_fresh_run(tmp_path):
    assert read_latest(tmp_path) is None


@pytest.mark.parametrize("text, needle", [("", "is empty"), ("step_00000012\n", "names 'step_00000012'")])
def test_a_latest_naming_no_checkpoint_is_refused_with_the_fix(tmp_path, text, needle):
    _checkpoint(tmp_path, 4)
    (tmp_path / "step_00000012").mkdir()  # a save cut short: DeepSpeed's files may be there, ours are not
    (tmp_path / "latest").write_text(text)
    with pytest.raises(TrainingError) as err:
        read_latest(tmp_path)
    message = str(err.value)
    assert needle in message and "--force" in message
    assert "(checkpoints here: step_00000004)" in message  # the cut-short save is not offered
