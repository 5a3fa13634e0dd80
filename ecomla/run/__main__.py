"""`python -m ecomla.run RECIPE.yaml [--set KEY=VALUE ...] [--force]`: the launcher entry point.

    deepspeed --num_gpus 8 --module ecomla.run recipes/xecomla_llama3.2-1b.yaml
    torchrun --nproc_per_node 8 -m ecomla.run recipes/xecomla_llama3.2-1b.yaml

The same job as `ecomla run`: every rank distills, rank 0 converts and evaluates.
"""

from ecomla.recipe.command import launch
from ecomla.run.pipeline import run_file

launch("ecomla.run", "ecomla.run.recipe:RunRecipe", __doc__,
       lambda args: run_file(args.recipe, args.overrides, force=args.force, progress=not args.quiet))
