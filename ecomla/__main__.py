"""`python -m ecomla ...` is the same as the `ecomla` command."""

import sys

from ecomla.cli import main

sys.exit(main())
