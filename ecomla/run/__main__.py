"""`python -m ecomla.run RECIPE.yaml [--set KEY=VALUE ...] [--force]`: the launcher entry point.

    deepspeed --num_gpus 8 --module ecomla.run recipes/xecomla_llama3.2-1b.yaml
    torchrun --nproc_per_node 8 -m ecomla.run recipes/xecomla_llama3.2-1b.yaml

The same as `ecomla run`: every rank distills, rank 0 converts and evaluates.
"""

import sys

from ecomla.cli import main
from ecomla.distill.runtime import shutdown

code = main(["run", *[a for a in sys.argv[1:] if not a.startswith("--local_rank")]])
shutdown()
sys.exit(code)
