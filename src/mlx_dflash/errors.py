"""One exception type for every user-facing failure.

The CLI prints a DFlashError as a single line and exits; anything else is a bug
and keeps its traceback.
"""


class DFlashError(Exception):
    """A problem with the user's input: paths, model pairs, weights, arguments."""
