"""`python -m ecomla.distill RECIPE.yaml [--set KEY=VALUE ...] [--force]`: the launcher entry point.

    deepspeed --num_gpus 8 --module ecomla.distill recipes/distill/<name>.yaml
    torchrun --nproc_per_node 2 -m ecomla.distill recipes/distill/<name>.yaml

The same as `ecomla distill`, for launchers that start one process per GPU.
"""

import sys

from ecomla.cli import main
from ecomla.distill.runtime import shutdown

code = main(["distill", *[a for a in sys.argv[1:] if not a.startswith("--local_rank")]])
shutdown()
sys.exit(code)
