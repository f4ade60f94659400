"""What a run shows on the terminal: one line per stage and a progress bar for each long step (training updates
with loss and speed, decoding sentences, curve steps, gate training). Everything else, fairseq's config dumps,
module trees and warnings included, goes to the run's log file only (`<run dir>/<verb>.log`, Hydra's file
handler); `verbose=true` (or Hydra's `hydra.verbose=true`) puts it all on the terminal too. Errors stay one line.

Bars are drawn (tqdm, on stderr) only on a terminal: in a pipe or a CI log there are just the stage lines.
"""
from __future__ import annotations

import logging
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


def quiet_console(verbose: bool) -> None:
    """Called once Hydra has configured logging: unless verbose, the terminal handlers show stage lines only;
    Python warnings become log records (so they reach the log file, not the terminal)."""
    logging.captureWarnings(True)
    if verbose:
        return
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            if not any(isinstance(f, StageLinesOnly) for f in handler.filters):
                handler.addFilter(StageLinesOnly())
                handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))


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
