"""hprune's fairseq plugin: `fairseq-train/-generate --user-dir <this folder>` or `common.user_dir`.

Importing it registers the `hprune_transformer` model and allow-lists, for torch's safe checkpoint loader,
the few non-tensor globals fairseq checkpoints contain, so stock fairseq tools load hprune checkpoints
with `weights_only=True`.
"""
from .safe_load import allow_fairseq_checkpoint_globals

allow_fairseq_checkpoint_globals()

from . import criterion, model  # noqa: E402,F401  (registers the model and the L0 criterion with fairseq)
