"""Imports on demand: a command loads only what it needs. `ecomla convert` (its --help and the conversion code)
loads no DeepSpeed, lm-eval or PEFT, and importing the package or asking a command for --help loads neither
torch nor transformers."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("deepspeed", "lm_eval", "peft")


def loaded_after(code: str) -> set[str]:
    """Top-level packages in sys.modules after running `code` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_import_ecomla_loads_neither_torch_nor_transformers():
    loaded = loaded_after("import ecomla")
    assert not loaded & {"torch", "transformers", *HEAVY}


def test_convert_help_loads_no_framework():
    loaded = loaded_after("from ecomla.cli import main\ntry:\n    main(['convert', '--help'])\nexcept SystemExit:\n    pass")
    assert not loaded & {"transformers", *HEAVY}


def test_the_conversion_code_loads_no_deepspeed_lm_eval_or_peft():
    loaded = loaded_after("import ecomla.convert.stream, ecomla.convert.summary, ecomla.convert.targets")
    assert "transformers" in loaded  # the probe sees the conversion's own imports
    assert not loaded & set(HEAVY)
