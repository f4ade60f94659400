"""hprune's fairseq plugin: `fairseq-train/-generate --user-dir <this folder>` or `common.user_dir`.

Importing it registers the `hprune_transformer` and `hprune_moa` models, the `hprune` criterion and the pruning
mechanisms (mechanisms/), imports the modules named in HPRUNE_PLUGINS (os.pathsep-separated module names or .py
paths: mechanisms kept outside hprune, so that fairseq's worker processes know them too), and allow-lists, for
torch's safe checkpoint loader, the few non-tensor globals fairseq checkpoints contain, so stock fairseq tools
load hprune checkpoints with `weights_only=True`.

The package is shaped like fairseq's transformer package: config.py (the model flags, as dataclasses), layers.py
(the layers, encoder and decoder), model.py (the models and their architectures), heads/ (the head interface
and attention), mechanisms/ (what a pruning procedure trains inside the model), moa.py, marian.py, criterion.py,
safe_load.py.
"""
from hprune.registry import import_shared_plugins

from .safe_load import allow_fairseq_checkpoint_globals

allow_fairseq_checkpoint_globals()

from . import criterion, mechanisms, model  # noqa: E402,F401  (registers the models, criterion and mechanisms)

import_shared_plugins()
