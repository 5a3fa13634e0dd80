"""The one base of every error that a user can fix from its message alone.

The command line (`ecomla.cli`, and the launcher entry points `python -m ecomla.distill` and
`python -m ecomla.run`) prints such an error as one line, without a traceback, and exits with
status 2. Every module raises its own subclass (RecipeError, PlanError, DataError, ...), which
also keeps its builtin base (ValueError, RuntimeError) for callers that catch those.
"""


class UserError(Exception):
    """A problem with the input (recipe, data, checkpoint, environment), with the fix in its message."""
