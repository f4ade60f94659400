"""A checkpoint reference (`ckpt=`, hprune.open's first argument) is decided in one module, checkpoint_ref.py:
each form resolved into one CheckpointRef, which the command line's check before Hydra and the verb read alike."""
from __future__ import annotations

import ast
import json
import logging
import re
import subprocess as sp
import sys
from pathlib import Path

import pytest
from hprune_cli.main import overrides

from conftest import SMALL_DATA, hprune
from hprune.checkpoint_ref import CheckpointRef, Form, identify, resolve
from hprune.errors import UserError
from hprune.rundir import AVERAGED, BEST, LAST, PRUNED, RunDir

SRC = Path(__file__).resolve().parents[1] / "src" / "hprune"


def run_dir(root: Path, *checkpoints: str, verb: str = "train", finished: bool = True) -> RunDir:
    """A run dir as Hydra and a verb leave it (empty checkpoint files: nothing here reads them)."""
    (root / ".hydra").mkdir(parents=True)
    (root / ".hydra" / "config.yaml").write_text(f"verb: {verb}\n")
    if finished:
        (root / "metrics.json").write_text("{}")
    (root / "checkpoints").mkdir()
    for name in checkpoints:
        (root / "checkpoints" / name).write_bytes(b"")
    return RunDir(root)


def model_folder(folder: Path, *files: str, settings: bool = True) -> Path:
    """A model folder as `hprune data fetch` or the Hugging Face import leave it: dictionaries, hprune.yaml."""
    folder.mkdir(parents=True)
    for name in ("dict.en.txt", "dict.fr.txt", *files):
        (folder / name).write_text("")
    if settings:
        (folder / "hprune.yaml").write_text("tokenizer: moses\n")
    return folder


def hf_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "marian"}))
    return folder


def cli_adds_data(ckpt) -> bool:
    return overrides("eval", [f"ckpt={ckpt}"])[-1] == "data=pretrained"


# ------------------------------------------------------------------------------------------------ the forms
def test_a_run_dir_its_checkpoints_folder_and_its_files(tmp_path, caplog):
    run = run_dir(tmp_path / "run", BEST, LAST)
    for given in (run.path, run.checkpoints):
        ref = resolve(given)
        assert ref == CheckpointRef(str(given), Form.RUN_DIR, run.checkpoint(BEST), run)
        assert ref == identify(given) and not ref.brings_its_data
    (run.checkpoints / AVERAGED).write_bytes(b"")  # train.average_last's is preferred
    assert resolve(run.path).checkpoint == run.checkpoint(AVERAGED)
    assert resolve(run.checkpoint(LAST)) == CheckpointRef(str(run.checkpoint(LAST)), Form.FILE, run.checkpoint(LAST), run)

    stopped = run_dir(tmp_path / "stopped", BEST, LAST, finished=False)
    with pytest.raises(UserError, match=f"did not finish.*hprune train.*ckpt={re.escape(str(stopped.checkpoint(LAST)))}"):
        resolve(stopped.path)
    with caplog.at_level(logging.WARNING, logger="hprune.checkpoint_ref"):
        assert resolve(stopped.checkpoint(LAST)).run == stopped  # a file of it: used as it is, with a warning
    assert "belongs to a run that did not finish" in caplog.text


def test_a_model_folder_its_model_and_an_imported_models_pruned_checkpoint(tmp_path):
    folder = model_folder(tmp_path / "models" / "wmt14.en-fr", "model.pt", "bpecodes")
    ref = resolve(folder)
    assert ref == CheckpointRef(str(folder), Form.MODEL_FOLDER, folder / "model.pt", model_folder=folder)
    assert ref.brings_its_data and ref == identify(folder)
    assert resolve(folder / "model.pt") == CheckpointRef(str(folder / "model.pt"), Form.FILE, folder / "model.pt",
                                                         model_folder=folder)
    by_hand = model_folder(tmp_path / "unpacked", "model.pt", settings=False)  # data=pretrained needs saying
    assert resolve(by_hand) == CheckpointRef(str(by_hand), Form.MODEL_FOLDER, by_hand / "model.pt")

    # a prune run's physically pruned checkpoint of an imported model: the model's files copied beside it
    pruned_run = run_dir(tmp_path / "prune", PRUNED, verb="prune")
    for name in ("dict.en.txt", "dict.fr.txt", "hprune.yaml"):
        (pruned_run.checkpoints / name).write_text("")
    ref = resolve(pruned_run.checkpoint(PRUNED))
    assert ref == CheckpointRef(str(pruned_run.checkpoint(PRUNED)), Form.FILE, pruned_run.checkpoint(PRUNED),
                                pruned_run, model_folder=pruned_run.checkpoints)
    assert ref.brings_its_data


def test_an_ensemble_names_its_members_and_is_refused(tmp_path):
    folder = model_folder(tmp_path / "wmt19.en-ru.ensemble", *(f"model{i}.pt" for i in (1, 2, 10)))
    ref = identify(folder)
    assert ref.checkpoint is None and [p.name for p in ref.ensemble] == ["model1.pt", "model2.pt", "model10.pt"]
    with pytest.raises(UserError, match=r"ensemble of 3 models \(model1.pt, model2.pt, model10.pt\)"):
        resolve(folder)
    assert resolve(folder / "model2.pt").checkpoint == folder / "model2.pt"


def test_nothing_there_is_a_file_reading_says_is_missing(tmp_path):
    assert resolve(tmp_path / "nope.pt") == CheckpointRef(str(tmp_path / "nope.pt"), Form.FILE, tmp_path / "nope.pt")
    assert resolve(tmp_path).checkpoint == tmp_path / BEST


def test_a_published_name_is_its_folder_under_the_models_root(tmp_path, monkeypatch):
    name = "wmt19.en-de.joined-dict.single_model"
    monkeypatch.chdir(tmp_path)
    assert identify(name) == CheckpointRef(name, Form.PUBLISHED, published=name) and identify(name).brings_its_data
    folder = model_folder(tmp_path / "models" / name, "model.pt")  # as `hprune data fetch published=NAME` left it
    ref = resolve(name, tmp_path / "models", tmp_path / "data-bin")  # (fetched already: no download)
    assert ref == CheckpointRef(name, Form.PUBLISHED, folder / "model.pt", model_folder=folder, published=name)
    model_folder(tmp_path / name, "model.pt", settings=False)  # a path here wins over a name
    assert resolve(name) == CheckpointRef(name, Form.MODEL_FOLDER, Path(name) / "model.pt")


def test_a_hugging_face_folder_and_a_hub_id_are_imported_once(tmp_path, monkeypatch):
    pytest.importorskip("fairseq")
    from hprune import backend, checkpoint_ref

    imported, fetched = [], []

    def import_hf(folder, models_root):  # backend/hf.py's conversion, its folder as it leaves it
        imported.append((folder, models_root))
        return model_folder(models_root / "hf" / f"{folder.name}-0123", "model.pt") / "model.pt"

    def fetch_hub(repo, models_root):
        fetched.append((repo, models_root))
        return snapshot

    monkeypatch.setattr(backend, "import_hf", import_hf)
    monkeypatch.setattr(checkpoint_ref, "fetch_hub", fetch_hub)
    models = tmp_path / "models"
    folder = hf_folder(tmp_path / "opus-mt-en-fr")
    assert identify(folder) == CheckpointRef(str(folder), Form.HF_FOLDER, hf_folder=folder)
    assert identify(folder).brings_its_data
    own = models / "hf" / "opus-mt-en-fr-0123"
    assert resolve(folder, models) == CheckpointRef(str(folder), Form.HF_FOLDER, own / "model.pt", model_folder=own,
                                                    hf_folder=folder)
    assert imported == [(folder, models)]

    snapshot = hf_folder(tmp_path / "cache" / "models--Helsinki-NLP--opus-mt-en-de" / "snapshots" / "abc")
    assert identify(snapshot).hub_id == "Helsinki-NLP/opus-mt-en-de"  # a snapshot of the cache, given as a path
    monkeypatch.chdir(tmp_path)
    repo = "Helsinki-NLP/opus-mt-en-de"
    assert identify(repo) == CheckpointRef(repo, Form.HUB, hub_id=repo) and identify(repo).brings_its_data
    own = models / "hf" / "abc-0123"
    assert resolve(repo, models) == CheckpointRef(repo, Form.HUB, own / "model.pt", model_folder=own,
                                                  hf_folder=snapshot, hub_id=repo)
    assert fetched == [(repo, models)] and imported[-1] == (snapshot, models)


# ------------------------------------------------------------------------------------------------ one meaning
def test_the_command_line_adds_data_where_the_resolved_reference_brings_it(tmp_path, monkeypatch):
    """The check before Hydra (data=pretrained unless the command line chose data) is identify's answer, which
    for a reference on disk is the very object the verb resolves."""
    run = run_dir(tmp_path / "run", BEST)
    folder = model_folder(tmp_path / "model", "model.pt")
    pruned = run_dir(tmp_path / "prune", PRUNED, verb="prune")
    (pruned.checkpoints / "hprune.yaml").write_text("")
    on_disk = [run.path, run.checkpoint(BEST), folder, folder / "model.pt", pruned.checkpoint(PRUNED),
               tmp_path / "nope.pt", hf_folder(tmp_path / "hf") / "config.json"]
    for ckpt in on_disk:
        ref = resolve(ckpt)
        assert identify(ckpt) == ref
        assert cli_adds_data(ckpt) is ref.brings_its_data, ckpt
    monkeypatch.chdir(tmp_path)
    for name in ("Helsinki-NLP/opus-mt-en-de", "wmt14.en-fr.joined-dict.transformer"):  # fetched by the verb
        assert cli_adds_data(name) and identify(name).brings_its_data
    assert overrides("eval", [f"ckpt={folder}", "data=databin"])[-1] == "data=databin"  # a choice made stays
    assert not cli_adds_data(f"{folder},{run.path}")  # a sweep over references: each may be another form


def test_the_command_line_and_the_verb_read_the_same_reference(trained_run, tmp_path, monkeypatch):
    """`hprune eval ckpt=<run>`: the command line identifies it before Hydra, the session resolves it, and both
    give the one CheckpointRef whose checkpoint the verb measured."""
    from hprune import checkpoint_ref, session

    identified, resolved = [], []
    real_identify, real_resolve = checkpoint_ref.identify, checkpoint_ref.resolve
    monkeypatch.setattr(checkpoint_ref, "identify", lambda ckpt: identified.append(real_identify(ckpt)) or identified[-1])
    monkeypatch.setattr(session, "resolve", lambda *args: resolved.append(real_resolve(*args)) or resolved[-1])
    out = tmp_path / "eval"
    hprune("eval", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu")
    assert len(resolved) == 1 and identified[0] == resolved[0]  # (resolve identifies too: the same answer)
    assert resolved[0].form is Form.RUN_DIR and resolved[0].run == RunDir(trained_run)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["checkpoint"] == str(resolved[0].checkpoint.absolute())


def test_identifying_a_reference_is_light():
    """The command line asks before any verb is imported: no torch, no fairseq, no Hydra."""
    code = ("import sys; from hprune.checkpoint_ref import identify; identify('Helsinki-NLP/x'); identify('x.pt'); "
            "print(sorted(m for m in ('torch', 'fairseq', 'hydra') if m in sys.modules))")
    assert sp.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def _calls(path: Path, names: set) -> set:
    """The names among `names` a source calls or reads (as a name, or an attribute such as RunDir.of)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name) and node.id in names:
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and f"{node.value.id}.{node.attr}" in names:
            found.add(f"{node.value.id}.{node.attr}")
    return found


def test_what_a_reference_means_is_decided_in_one_module():
    """Only checkpoint_ref.py finds a reference's run, tells a Hub id, fetches or imports a model for it. Beside
    it: reporting finds the run of a checkpoint recorded in metrics.json (it lies below the references), `hprune
    data fetch` fetches (its hf= and published=, no checkpoint reference), hub.py checks its own hf= value."""
    allowed = {"RunDir.of": {"checkpoint_ref.py", "reporting/collect.py"},
               "HUB_ID": {"checkpoint_ref.py", "model_folder.py", "hub.py"},
               "import_hf": {"checkpoint_ref.py", "backend/__init__.py"},
               "fetch_hub": {"checkpoint_ref.py", "runner/data.py"},
               "fetch_published": {"checkpoint_ref.py", "runner/data.py"}}
    users = {name: set() for name in allowed}
    for path in SRC.rglob("*.py"):
        for name in _calls(path, set(allowed)):
            users[name].add(str(path.relative_to(SRC)))
    for name, files in users.items():
        assert files <= allowed[name], (name, sorted(files - allowed[name]))
    cli = (SRC.parents[1] / "cli" / "main.py").read_text()
    assert "checkpoint_ref import identify" in cli and "model_folder" not in cli
