"""What every recipe-driven command shares: its arguments, its help, and how its errors are printed.

`ecomla.cli` builds the `ecomla` command from these; the launcher entry points
(`python -m ecomla.distill`, `python -m ecomla.run`, started once per GPU by
deepspeed or torchrun) build their one command from the same pieces, so neither
imports the other.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from ecomla.errors import UserError
from ecomla.recipe.schema import format_fields


def add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="path to the YAML recipe")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set mla.kv_lora_rank=64 (repeatable; values are YAML)",
    )
    p.add_argument("--force", action="store_true", help="replace the output directory if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


EXTENDS_HELP = """

extends: OTHER.yaml (top level, any recipe file): build on another recipe. OTHER.yaml is read first (a path
  relative to this file; it may extend another in turn), then this file's keys are merged over it, mapping by
  mapping at every depth: a list or a value replaces the other's. --set applies last. The resolved recipe is what
  runs and what is saved beside the outputs, so reruns reuse stages exactly as if the keys were written out."""


class RecipeHelpParser(argparse.ArgumentParser):
    """An ArgumentParser whose epilog lists a recipe class's keys, built only when help is shown.

    Importing every recipe module (and with them torch and transformers) to build the epilogs costs seconds
    that a command which never prints help should not pay.
    """

    def __init__(self, *args, recipe: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.recipe = recipe  # "module:Class" of the recipe whose keys the epilog lists

    def format_help(self) -> str:
        if self.recipe is not None and self.epilog is None:
            module, name = self.recipe.rsplit(":", 1)
            cls = getattr(__import__(module, fromlist=[name]), name)
            self.epilog = "recipe keys:\n" + format_fields(cls) + EXTENDS_HELP
        return super().format_help()


def run_job(command: str, job: Callable[[], None]) -> int:
    """Run `job`; a UserError (or an output that exists) prints one line on rank 0 and gives exit status 2."""
    try:
        job()
    except (UserError, FileExistsError) as err:
        if os.environ.get("RANK", "0") == "0":  # one message per run, not one per process
            print(f"ecomla {command}: error: {err}", file=sys.stderr)
        return 2
    return 0


def launcher_args(module: str, recipe: str, description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The arguments of a launcher entry point (`python -m MODULE RECIPE.yaml ...`), without the launcher's own
    --local_rank."""
    p = RecipeHelpParser(prog=f"python -m {module}", description=description, recipe=recipe,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recipe_args(p)
    argv = sys.argv[1:] if argv is None else argv
    return p.parse_args([a for a in argv if not a.startswith("--local_rank")])


def launch(module: str, recipe: str, description: str, job) -> None:
    """A launcher entry point (`python -m MODULE RECIPE.yaml ...`, once per process under deepspeed/torchrun):
    parse the recipe arguments, run job(args) with one-line errors, leave the process group, exit."""
    from ecomla.distill.runtime import shutdown

    args = launcher_args(module, recipe, description)
    code = run_job(module.rpartition(".")[2], lambda: job(args))
    shutdown()
    sys.exit(code)
