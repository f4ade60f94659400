"""What a run shows on the terminal: one line per stage and a progress bar for each long step (training updates
with loss and speed, decoding sentences, curve steps, gate training). Everything else, fairseq's config dumps,
module trees and warnings included, goes to the run's log file only (`<run dir>/<verb>.log`, Hydra's file
handler); `verbose=true` (or Hydra's `hydra.verbose=true`) puts it all on the terminal too. Errors stay one line.

Bars are drawn (tqdm, on stderr) only on a terminal: in a pipe or a CI log there are just the stage lines.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from contextlib import contextmanager
from typing import Iterator, Optional

STAGE_LOGGERS = ("hprune",)  # whose INFO records are the stage lines
_FIELDS = re.compile(r"(\w+)=(-?[\d.]+)")


class StageLinesOnly(logging.Filter):
    """For the console handler: hprune's own lines, and anyone's errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.name.split(".")[0] in STAGE_LOGGERS


def quiet_console(verbose: bool, errors_only: bool = False) -> None:
    """Called once Hydra has configured logging: unless verbose, the terminal handlers show stage lines only;
    Python warnings become log records (so they reach the log file, not the terminal). errors_only: the
    terminal shows errors alone (a training's workers other than rank 0)."""
    logging.captureWarnings(True)
    for handler in _console_handlers():
        handler.setLevel(logging.ERROR if errors_only else logging.NOTSET)
    if verbose:
        return
    for handler in _console_handlers():
        if not any(isinstance(f, StageLinesOnly) for f in handler.filters):
            handler.addFilter(StageLinesOnly())
            handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))


def _console_handlers() -> list:
    return [h for h in logging.getLogger().handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]


class Bar:
    """A progress bar, or nothing where stderr is not a terminal."""

    def __init__(self, label: str, total: Optional[int], unit: str, leave: bool):
        from tqdm import tqdm

        scale = unit == "B"  # bytes: kB, MB, GB
        self.bar = tqdm(total=total, desc=label, unit=unit, leave=leave, dynamic_ncols=True, file=sys.stderr,
                        unit_scale=scale, unit_divisor=1024 if scale else 1000,
                        disable=None if sys.stderr.isatty() else True)
        self.position = 0

    def advance(self, n: int = 1, **fields) -> None:
        self.goto(self.position + n, **fields)

    def goto(self, position: int, **fields) -> None:
        if position > self.position:
            self.bar.update(position - self.position)
            self.position = position
        if fields:
            self.bar.set_postfix(fields, refresh=False)

    def close(self) -> None:
        self.bar.close()


@contextmanager
def progress(label: str, total: Optional[int], unit: str, leave: bool = True) -> Iterator[Bar]:
    bar = Bar(label, total, unit, leave)
    try:
        yield bar
    finally:
        bar.close()


class _TrainingLines(logging.Handler):
    """Moves a bar along fairseq's progress records (`train_inner`: num_updates=, loss=, ups=)."""

    def __init__(self, bar: Bar):
        super().__init__(logging.INFO)
        self.bar = bar

    def emit(self, record: logging.LogRecord) -> None:
        fields = dict(_FIELDS.findall(record.getMessage()))
        if "num_updates" in fields:
            shown = {k: fields[k] for k in ("loss", "ups") if k in fields}
            self.bar.goto(int(float(fields["num_updates"])), **shown)


@contextmanager
def training_progress(label: str, total: Optional[int]) -> Iterator[Bar]:
    """A bar for a fairseq-train run in this process, fed by its progress records."""
    with progress(label, total, "upd") as bar:
        handler, source = _TrainingLines(bar), logging.getLogger("train_inner")
        source.addHandler(handler)
        try:
            yield bar
        finally:
            source.removeHandler(handler)


def is_verbose() -> bool:
    """Whether the terminal shows everything (no handler holds StageLinesOnly)."""
    return not any(isinstance(f, StageLinesOnly) for h in logging.getLogger().handlers for f in h.filters)


def log_file() -> Optional[str]:
    """The run's log file (Hydra's file handler), if this process has one."""
    files = [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    return next((f for f in files if f != os.devnull), None)


@contextmanager
def to_log_file_only(name: str) -> Iterator[None]:
    """Send logger `name`'s records (e.g. torch's elastic agent, which logs on its own stderr handler) to the run's
    log file alone while the block runs."""
    logger = logging.getLogger(name)
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    propagate, logger.propagate = logger.propagate, False
    for handler in files:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for handler in files:
            logger.removeHandler(handler)
        logger.propagate = propagate


def worker_console(log_path: Optional[str], verbose: bool, rank_zero: bool) -> None:
    """The logging of a training worker that hprune started: rank 0 logs as the verb's process does (stage lines
    on the terminal, everything appended to the run's log file); the others show only their errors."""
    root = logging.getLogger()
    root.addHandler(logging.StreamHandler(sys.stdout))
    root.setLevel(logging.INFO)
    if rank_zero and log_path:
        file = logging.FileHandler(log_path)
        file.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(file)
    quiet_console(verbose, errors_only=not rank_zero)
