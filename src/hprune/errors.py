"""The one error type that reaches the user as a single line (no traceback)."""


class UserError(Exception):
    """Bad input: the message names the problem and the fix, on one line."""


class JobFailed(UserError):
    """Not bad input but a failure outside hprune's hands (a worker killed): one line too, saying what to do."""
