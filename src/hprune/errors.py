"""The one error type that reaches the user as a single line (no traceback), and hprune's exit statuses.

Exit statuses (docs/scaling.md): 0 done; 1 an unexpected error (a traceback: a bug to report); 2 bad input (one
line naming the problem and the fix); 3 a job or a worker failed (one line; what was saved is kept and the same
command resumes); a process killed by signal N ends with 128 + N (the shell's, SLURM's and torchrun's way): Ctrl-C
(SIGINT) 130 and SIGTERM 143, each one line, with nothing half-written left behind."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

EXIT_BAD_INPUT, EXIT_JOB_FAILED = 2, 3
STOP_SIGNALS = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "stopped (SIGTERM)"}


class UserError(Exception):
    """Bad input: the message names the problem and the fix, on one line."""

    exit_status = EXIT_BAD_INPUT


class JobFailed(UserError):
    """Not bad input but a failure outside hprune's hands (a worker killed): one line too, saying what to do."""

    exit_status = EXIT_JOB_FAILED


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM, raised where the process is: `finally` blocks and cleanups run on the way out
    (files.build_once removes its staging folder), and `except Exception` does not swallow it. The CLI says it
    in one line and exits with 128 + the signal's number."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)

    @property
    def exit_status(self) -> int:
        return 128 + self.signum

    def describe(self) -> str:
        return STOP_SIGNALS.get(self.signum, f"stopped ({signal.Signals(self.signum).name})")


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """While the block runs in this process, SIGINT and SIGTERM raise Interrupted in it (in the main thread; other
    threads cannot take signals), unless they were ignored when it began. A forked child that keeps the handler
    ends as the signal ends any process, without a traceback, and its parent says it in one line; a signal that
    reaches a child before Python has finished forking is lost, though, so a pool holds the signals back while it
    forks and its workers take the default action (data/processing.py)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    main_pid = os.getpid()

    def stop(signum, frame):
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Interrupted(signum)

    # a signal ignored already stays ignored: `nohup`, or a job a script started in the background (the shell
    # ignores Ctrl-C for it)
    before = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS
              if signal.getsignal(signum) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def as_interrupted(err: BaseException) -> "Interrupted | None":
    """The stop behind an exception: Ctrl-C's KeyboardInterrupt, Interrupted, or torch's elastic launcher's
    SignalException (it installs its own handlers while it runs a training's workers); else None."""
    if isinstance(err, Interrupted):
        return err
    if isinstance(err, KeyboardInterrupt):
        return Interrupted(signal.SIGINT)
    sigval = getattr(err, "sigval", None)
    if type(err).__name__ == "SignalException" and sigval is not None:
        return Interrupted(int(sigval))
    return None
