# Sourced by scripts/reproduce_*.sh: run one hprune step locally, or on SLURM.
#   LAUNCHER=local (default): in this shell, one run after the other; sweeps run their jobs one by one
#                             (HPRUNE_JOBS=N with LAUNCHER=joblib runs N at once).
#   LAUNCHER=slurm:           every step is a multirun submitted through hydra/launcher=slurm; Hydra waits for
#                             its jobs, so the steps still run in order. Set the partition etc. in SLURM_ARGS,
#                             e.g. SLURM_ARGS="hydra.launcher.partition=gpu hydra.launcher.timeout_min=2880".
#   HPRUNE_ARGS:              more overrides for every step (e.g. paths.data_root=/scratch/data-bin).
#   HPRUNE:                   the command (default: hprune; `HPRUNE="echo hprune"` prints the plan instead).
set -euo pipefail
if [[ -z "${HPRUNE:-}" ]]; then  # hprune on PATH (an activated venv, a pip install), else the one `make install` made
  _root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  if command -v hprune > /dev/null; then HPRUNE=hprune
  elif [[ -x "$_root/.venv/bin/hprune" ]]; then HPRUNE="$_root/.venv/bin/hprune"
  else echo "hprune is not installed: run make install (or pip install .) first" >&2; exit 2
  fi
fi
LAUNCHER=${LAUNCHER:-local}

_launcher_args() {
  case "$LAUNCHER" in
    local) ;;
    joblib) echo "hydra/launcher=local" ;;
    slurm) echo "hydra/launcher=slurm ${SLURM_ARGS:-}" ;;
    *) echo "LAUNCHER must be local, joblib or slurm, not '$LAUNCHER'" >&2; exit 2 ;;
  esac
}

# step VERB DIR OVERRIDE... : one run whose outputs go to DIR ("data prepare" counts as one verb)
step() {
  local verb=$1 dir=$2
  shift 2
  if [[ "$LAUNCHER" == local ]]; then
    $HPRUNE $verb "hydra.run.dir=$dir" "$@" ${HPRUNE_ARGS:-}
  else
    $HPRUNE $verb -m "hydra.sweep.dir=$dir" hydra.sweep.subdir=. $(_launcher_args) "$@" ${HPRUNE_ARGS:-}
  fi
}

# cpu_step VERB DIR OVERRIDE... : a step that needs no GPU (data preparation)
cpu_step() {
  if [[ "$LAUNCHER" == slurm ]]; then
    step "$@" hydra.launcher.gpus_per_node=0
  else
    step "$@"
  fi
}

# sweep VERB DIR OVERRIDE... : a multirun (key=a,b,c); job i writes DIR/i
sweep() {
  local verb=$1 dir=$2
  shift 2
  $HPRUNE $verb -m "hydra.sweep.dir=$dir" $(_launcher_args) "$@" ${HPRUNE_ARGS:-}
}
