"""The one exception type user mistakes travel in.

Anything raised as `GlimmerError` reaches the CLI as a single `error: ...`
line and a non-zero exit; everything else is a bug and keeps its traceback.
"""


class GlimmerError(Exception):
    """A problem with the user's input: a file, a flag, a mismatched pair."""
