"""The command line: help that lists every recipe key, and a real conversion through the console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from ecomla.cli import main
from ecomla.convert.recipe import ConvertRecipe
from ecomla.recipe.schema import describe_fields


def test_help_lists_every_recipe_key(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["convert", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for key, _type, _default, help_text in describe_fields(ConvertRecipe):
        assert key in out
        assert help_text, f"{key} has no help text"


def test_top_level_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "convert" in out and "analyze" in out


def test_console_script_converts(source_factory, tmp_path):
    src = source_factory("llama")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(src), "output_dir": str(tmp_path / "out"), "device": "cpu",
                                      "mla": {"kv_lora_rank": 16, "qk_rope_head_dim": 8}}))
    exe = os.path.join(os.path.dirname(sys.executable), "ecomla")
    proc = subprocess.run([exe, "convert", str(recipe), "--set", "mla.kv_lora_rank=24", "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "compression: 2x" in proc.stdout  # 64 / (24 + 8)
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert report["kv_lora_rank"] == 24
    saved = yaml.safe_load((tmp_path / "out" / "ecomla_recipe.yaml").read_text())
    assert saved["mla"]["kv_lora_rank"] == 24  # the resolved recipe, overrides applied
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        assert (tmp_path / "out" / name).exists(), name


@pytest.mark.parametrize("module", ["ecomla", "ecomla.run", "ecomla.distill"])
def test_the_module_launchers_answer_help(module):
    """`python -m ecomla`, and the launchers deepspeed and torchrun start (`-m ecomla.run`, `-m ecomla.distill`)."""
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:500]
