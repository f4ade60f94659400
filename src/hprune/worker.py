"""`python -m hprune.worker [options] -- ARGV`: one worker of a training that `backend.train` started on this
node (backend/distributed.start_workers): fairseq-train with ARGV, at the place in the job that the elastic
launcher's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) give it.

Outside the backend package so that its logging is set up before fairseq is imported (some fairseq modules
call logging.basicConfig at import, which would print their import-time records on the terminal)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from .console import worker_console
from .errors import UserError, as_interrupted, signals_raise
from .files import write_atomic
from .launch import launched


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hprune.worker")
    parser.add_argument("--label", default="train")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads in this worker")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a collective waits for a peer")
    parser.add_argument("--speed-file", help="rank 0 writes its training speed here (JSON)")
    parser.add_argument("--log-file", help="rank 0 appends its log here (the run's log file)")
    parser.add_argument("--verbose", action="store_true", help="rank 0 shows everything on the terminal")
    parser.add_argument("fairseq_argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    fairseq_argv = args.fairseq_argv[1:] if args.fairseq_argv[:1] == ["--"] else args.fairseq_argv
    workers = launched()
    worker_console(args.log_file, args.verbose, workers.rank_zero)
    import torch

    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # as set here: run_worker leaves it
    try:
        from .backend.training import run_worker

        with signals_raise():  # Ctrl-C reaches every worker: the launching process says it, in one line
            speed = run_worker(fairseq_argv, args.label, args.timeout)
    except KeyboardInterrupt as err:
        sys.exit(as_interrupted(err).exit_status)
    except Exception as err:  # the launching process reports it in one line; a traceback goes to the log file
        if not isinstance(err, UserError):
            logging.getLogger("worker").warning("worker %d of %d failed", workers.rank, workers.world_size,
                                                exc_info=True)
        _record(err)
        sys.exit(1)
    if workers.rank_zero and args.speed_file:
        write_atomic(Path(args.speed_file), json.dumps(speed))


def _record(err: Exception) -> None:
    """The failure's one line, where the elastic agent reads it (its error-file format)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        message = str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {err}".splitlines()[0]
        Path(path).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))


if __name__ == "__main__":
    main()
