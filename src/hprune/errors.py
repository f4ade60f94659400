"""The one error type that reaches the user as a single line (no traceback), and hprune's exit statuses.

Exit statuses (docs/scaling.md): 0 done; 1 an unexpected error (a traceback: a bug to report); 2 bad input (one
line naming the problem and the fix); 3 a job or a worker failed (one line; what was saved is kept and the same
command resumes); a process killed by signal N ends with 128 + N (the shell's, SLURM's and torchrun's way)."""

EXIT_BAD_INPUT, EXIT_JOB_FAILED = 2, 3


class UserError(Exception):
    """Bad input: the message names the problem and the fix, on one line."""

    exit_status = EXIT_BAD_INPUT


class JobFailed(UserError):
    """Not bad input but a failure outside hprune's hands (a worker killed): one line too, saying what to do."""

    exit_status = EXIT_JOB_FAILED
