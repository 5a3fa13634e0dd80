"""`python -m ecomla.distill RECIPE.yaml [--set KEY=VALUE ...] [--force]`: the launcher entry point.

    deepspeed --num_gpus 8 --module ecomla.distill recipes/distill/<name>.yaml
    torchrun --nproc_per_node 2 -m ecomla.distill recipes/distill/<name>.yaml

The same job as `ecomla distill`, for launchers that start one process per GPU.
"""

from ecomla.recipe.command import launch


def distill(args) -> None:
    from ecomla.distill.recipe import load_distill_recipe
    from ecomla.distill.trainer import run

    run(load_distill_recipe(args.recipe, args.overrides), force=args.force, progress=not args.quiet)


launch("ecomla.distill", "ecomla.distill.recipe:DistillRecipe", __doc__, distill)
