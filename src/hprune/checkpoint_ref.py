"""What a checkpoint reference means (every verb's `ckpt=`, hprune.open's first argument), decided here once.

A reference is one of these forms:
    run dir          a train run's folder (or its checkpoints/): the averaged checkpoint where the run made one
                     (train.average_last), else checkpoint_best.pt; a run that did not finish is refused
    checkpoint file  a .pt file, as given. One in <run>/checkpoints/ belongs to that run (used with a warning if
                     the run did not finish); one with hprune.yaml beside it belongs to that model folder: a
                     published or imported model's model.pt, or a pruned checkpoint of one (the model's files
                     are copied beside it)
    model folder     a folder holding model.pt (fetched, imported, unpacked by hand) or fairseq's checkpoints; an
                     ensemble's (model1.pt, model2.pt, ...) is refused: pass one member
    Hugging Face folder  what save_pretrained wrote (config.json): imported once as a model folder under
                     <models_root>/hf/ (backend/hf.py)
    Hub id           ORG/NAME that is no path here: fetched into the Hugging Face cache (hub.py), then imported
    published name   one of fairseq's published models (data/published.py): fetched into <models_root>/NAME/

`identify(ckpt)` tells which from the files here alone: no download, no import, no refusal. The command line asks
it before Hydra (a reference that brings its own data settings needs no data=). `resolve(ckpt, models_root,
data_root)` also fetches and imports, refuses what no verb can read, and names the checkpoint file. Both give a
CheckpointRef; the CLI, hprune.open, the session (Session.open resolves) and Voita's recipe lookup ask it
instead of looking at `ckpt` again. Light to import (the CLI does): the downloads and the import are imported
when a reference needs them.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from .errors import UserError
from .hub import fetch_hub, snapshot_repo
from .model_folder import HUB_ID, SETTINGS_FILE, folder_of, is_hf_dir
from .rundir import AVERAGED, BEST, LAST, RunDir

log = logging.getLogger(__name__)
MODEL_FILE = "model.pt"  # a model folder's checkpoint (fairseq's tarballs, hprune's imports)
FOLDER_CHECKPOINTS = (AVERAGED, BEST, MODEL_FILE)  # a folder's checkpoint: the first of these it holds


class Form(enum.Enum):
    RUN_DIR = "run dir"
    FILE = "checkpoint file"
    MODEL_FOLDER = "model folder"
    HF_FOLDER = "Hugging Face folder"
    HUB = "Hub id"
    PUBLISHED = "published name"


@dataclass(frozen=True)
class CheckpointRef:
    given: str                            # the reference as written
    form: Form
    # the fairseq checkpoint file verbs read; None until resolve() fetches or imports it (a Hub id, a published
    # name, a Hugging Face folder), and for an ensemble (no one member named)
    checkpoint: Optional[Path] = None
    run: Optional[RunDir] = None          # the run dir whose checkpoints/ hold it
    model_folder: Optional[Path] = None   # the folder with the model's own files and hprune.yaml (data=pretrained)
    hf_folder: Optional[Path] = None      # the Hugging Face folder it is, or is imported from
    hub_id: Optional[str] = None          # ORG/NAME of the Hub repository it comes from
    published: Optional[str] = None       # the name of the fairseq published model it is
    ensemble: tuple[Path, ...] = ()       # an ensemble folder's members, in order

    @property
    def brings_its_data(self) -> bool:
        """Its data settings come with it (hprune.yaml, written by the fetch or the import where not there yet):
        verbs given it need no data= (the CLI adds data=pretrained)."""
        return any(value is not None for value in (self.model_folder, self.hf_folder, self.hub_id, self.published))


def identify(ckpt: str | Path) -> CheckpointRef:
    """What `ckpt` is, from the files here alone (nothing fetched, imported or refused)."""
    given = str(ckpt)
    path = Path(given).expanduser()
    if not path.exists():  # a path here wins over a name
        if HUB_ID.fullmatch(given):  # as from_pretrained takes it
            return CheckpointRef(given, Form.HUB, hub_id=given)
        if given in _published_names():
            return CheckpointRef(given, Form.PUBLISHED, published=given)
    if is_hf_dir(path):
        return CheckpointRef(given, Form.HF_FOLDER, hf_folder=path, hub_id=snapshot_repo(path))
    return _on_disk(given, path)


def resolve(ckpt: str | Path, models_root: str | Path = "data-bin/models",
            data_root: str | Path = "data-bin") -> CheckpointRef:
    """`ckpt` with its checkpoint file: a Hub id or a published name fetched (into the Hugging Face cache, or
    <models_root>/NAME/ with its archive under <data_root>/downloads/), a Hugging Face model imported under
    <models_root>/hf/, each once; a run that did not finish and an ensemble refused in one line."""
    ref = identify(ckpt)
    if ref.form is Form.HUB:
        ref = _imported(replace(ref, hf_folder=fetch_hub(ref.hub_id, Path(models_root))), models_root)
    elif ref.form is Form.HF_FOLDER:
        ref = _imported(ref, models_root)
    elif ref.form is Form.PUBLISHED:
        from .data.published import fetch_published

        folder = fetch_published(ref.published, Path(models_root), Path(data_root) / "downloads")
        ref = replace(_on_disk(ref.given, folder), form=Form.PUBLISHED, published=ref.published)
    _refuse_unusable(ref)
    return ref


# ------------------------------------------------------------------------------------------------ the forms
def _on_disk(given: str, path: Path) -> CheckpointRef:
    """A checkpoint file (or a path with nothing there: reading it says so), a run dir or a folder of checkpoints."""
    run = RunDir.of(path)
    if not path.is_dir():
        return CheckpointRef(given, Form.FILE, path, run, *_own_files(folder_of(path)))
    folder = RunDir(path).checkpoints if RunDir(path).checkpoints.is_dir() else path
    checkpoint = next((folder / name for name in FOLDER_CHECKPOINTS if (folder / name).exists()), None)
    members = () if checkpoint is not None else _ensemble(folder)
    if checkpoint is None and not members:
        checkpoint = folder / BEST  # (not there: reading it says so)
    form = Form.RUN_DIR if run is not None else Form.MODEL_FOLDER
    return CheckpointRef(given, form, checkpoint, run, *_own_files(folder), ensemble=members)


def _own_files(folder: Path) -> tuple[Optional[Path], Optional[Path]]:
    """(model_folder, hf_folder): `folder` where it holds a model's own files (hprune.yaml), or is a Hugging Face
    folder."""
    return (folder if (folder / SETTINGS_FILE).is_file() else None), (folder if is_hf_dir(folder) else None)


def _ensemble(folder: Path) -> tuple[Path, ...]:
    members = folder.glob("model[0-9]*.pt")
    return tuple(sorted(members, key=lambda p: int(p.stem[5:]) if p.stem[5:].isdigit() else 0))


def _published_names() -> tuple[str, ...]:
    from .data.published import PUBLISHED  # (only for a reference that is neither a path here nor a Hub id)

    return tuple(PUBLISHED)


def _imported(ref: CheckpointRef, models_root: str | Path) -> CheckpointRef:
    """A Hugging Face folder's reference, its import (a model folder with model.pt) made where not made yet."""
    from .backend import import_hf  # (the conversion: torch and fairseq)

    checkpoint = import_hf(ref.hf_folder, Path(models_root))
    return replace(ref, checkpoint=checkpoint, model_folder=folder_of(checkpoint))


def _refuse_unusable(ref: CheckpointRef) -> None:
    """One line for a folder no verb can read as one model; a warning for the checkpoint of an unfinished run."""
    run = ref.run
    if ref.form is Form.FILE and run is not None and not run.finished:
        log.warning("%s belongs to a run that did not finish (%s has no metrics.json): it is used as it is",
                    ref.checkpoint, run.path)
    if ref.form is Form.RUN_DIR and not run.finished:
        raise UserError(f"{run.path} is a run that did not finish (no metrics.json: it was stopped, or is still running), "
                        f"so its checkpoints are not its result; finish it with `{run.resume_command()}`, or pass "
                        f"ckpt={run.checkpoint(LAST)} to use its last checkpoint as it is")
    if ref.ensemble:
        members, folder = ref.ensemble, ref.ensemble[0].parent
        raise UserError(f"{folder} holds an ensemble of {len(members)} models ({', '.join(p.name for p in members)}); "
                        f"hprune measures one model at a time: pass one of them, e.g. ckpt={members[0]}")
