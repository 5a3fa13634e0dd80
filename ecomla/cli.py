"""The `ecomla` command line: one subcommand per job, each driven by a YAML recipe.

    ecomla convert RECIPE.yaml [--set KEY=VALUE ...] [--force]
    ecomla analyze recon RECIPE.yaml [--set KEY=VALUE ...] [--force]

Every recipe key, its type, default and meaning is listed by `ecomla <job> --help`.
Recipe problems are reported all at once, by dotted key, before anything runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from ecomla.recipe.schema import RecipeError, format_fields, load_recipe


class CliError(Exception):
    """An error to print as one clear message (no traceback), exit status 2."""


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
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


def _convert(args: argparse.Namespace) -> None:
    from ecomla.convert.converter import Converter
    from ecomla.convert.plan import make_plan
    from ecomla.convert.recipe import ConvertRecipe
    from ecomla.convert.summary import print_summary

    recipe = load_recipe(ConvertRecipe, args.recipe, overrides=args.overrides)
    plan = make_plan(recipe, force=args.force)
    report = Converter(plan, force=args.force, progress=not args.quiet).run()
    print_summary(report)


def _analyze_recon(args: argparse.Namespace) -> None:
    from ecomla.analyze.recon import ReconRecipe, run_recon

    recipe = load_recipe(ReconRecipe, args.recipe, overrides=args.overrides)
    run_recon(recipe, force=args.force, progress=not args.quiet)


def _recipe_epilog(cls_path: str) -> str:
    module, name = cls_path.rsplit(":", 1)
    cls = getattr(__import__(module, fromlist=[name]), name)
    return "recipe keys:\n" + format_fields(cls)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ecomla",
        description="Upcycle Llama/Mistral/Qwen2 checkpoints into stock DeepSeek-V3 MLA (smaller KV cache), "
        "then distill the quality back.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser(
        "convert",
        help="convert a checkpoint to stock DeepSeek-V3 MLA (SVD, calibration or random init)",
        description="Convert a Llama/Mistral/Qwen2 checkpoint into a stock DeepseekV3ForCausalLM checkpoint. "
        "Writes the weights, config, tokenizer, conversion_report.json and the resolved recipe.",
        epilog=_recipe_epilog("ecomla.convert.recipe:ConvertRecipe"),
        formatter_class=fmt,
    )
    _add_recipe_args(p)
    p.set_defaults(func=_convert)

    analyze = sub.add_parser("analyze", help="analyses of a source model (see `ecomla analyze --help`)")
    asub = analyze.add_subparsers(dest="analysis", metavar="ANALYSIS", required=True)
    p = asub.add_parser(
        "recon",
        help="K/V reconstruction error of a calibrated latent against calibration tokens, in and out of domain",
        description="Fit the MLA latent on N calibration tokens for several N, measure the relative "
        "reconstruction error of keys and values on held-out text of the same and of another domain, and "
        "write recon.json and recon.png.",
        epilog=_recipe_epilog("ecomla.analyze.recon:ReconRecipe"),
        formatter_class=fmt,
    )
    _add_recipe_args(p)
    p.set_defaults(func=_analyze_recon)
    return parser


def _errors() -> tuple[type[BaseException], ...]:
    from ecomla.convert.plan import PlanError
    from ecomla.convert.source import SourceError
    from ecomla.data.text import DataError
    from ecomla.io.checkpoint import CheckpointError

    return (CliError, RecipeError, PlanError, SourceError, CheckpointError, DataError, FileExistsError)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        func(args)
    except _errors() as err:
        print(f"ecomla {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
