"""The only hprune package (with the plugin) that imports fairseq; its public face.

Everything runs in this process through fairseq's own entry points (the pattern of fairseq's tests), so what
runs here is what `fairseq-preprocess`, `fairseq-train` and `fairseq-generate` run. One concern a module:
  compat      fairseq and Hydra in one process, devices and precisions
  commands    fairseq-train / fairseq-generate command lines, model and schedule checks
  training    binarize, train (resumable), checkpoint summaries and averaging
  distributed how many workers a training has, their fairseq flags, this node's workers started
              (each `python -m hprune.worker`)
  loading     open a checkpoint safely, export a physically pruned copy
  generation  beam search and teacher-forced batches over a split, split losses, sentences scored token by
              token
  hf          Hugging Face translation models imported as fairseq model folders
  finetuning  optimizer steps with a head mask held fixed
"""
from ..errors import UserError

try:
    import fairseq  # noqa: F401
except ImportError as err:  # raised inside a verb, so the user sees one line
    raise UserError(f"fairseq is not importable ({err}); run `make install` "
                    "(it installs fairseq-fixed==0.12.3.1 with --no-deps)") from None

from .commands import (  # noqa: E402
    check_generation,
    check_model,
    check_schedule,
    continue_training_argv,
    criterion_flags,
    flags,
    generation_argv,
    head_layout,
    tensorboard_flags,
    train_argv,
)
from .compat import HPRUNE_ARCHS, MOA_ARCHS, PLUGIN_DIR, resolve_device  # noqa: E402
from .finetuning import finetune  # noqa: E402
from .generation import (  # noqa: E402
    BeamSearchResult,
    batches,
    check_positions,
    sampled_batches,
    split_lengths,
    split_loss,
    split_symbols,
    split_targets,
    symbols_to_text,
    token_log_probs,
    translate,
    translate_each,
)  # noqa: E402
from .hf import import_hf  # noqa: E402
from .loading import (  # noqa: E402
    Checkpoint,
    Loaded,
    build_criterion,
    count_parameters,
    export_pruned,
    load_model,
    model_config,
    pruned_model,
    read_checkpoint,
)
from .training import (  # noqa: E402
    AVERAGED,
    average_checkpoints,
    binarize,
    checkpoint_summary,
    repair_resume_point,
    train,
    write_targets,
)

__all__ = ["AVERAGED", "HPRUNE_ARCHS", "MOA_ARCHS", "PLUGIN_DIR", "Checkpoint", "Loaded", "BeamSearchResult",
           "average_checkpoints", "batches", "binarize", "build_criterion", "check_generation", "check_model",
           "check_positions",
           "check_schedule", "checkpoint_summary", "continue_training_argv", "count_parameters", "criterion_flags",
           "export_pruned",
           "finetune", "flags", "generation_argv", "head_layout", "import_hf", "load_model", "model_config",
           "pruned_model", "read_checkpoint", "repair_resume_point",
           "resolve_device", "sampled_batches", "split_lengths", "split_loss",
           "split_symbols", "split_targets", "symbols_to_text", "tensorboard_flags", "token_log_probs", "train", "train_argv",
           "translate", "translate_each", "write_targets"]
