"""The command line: fast help, and one clear line (exit 2, no traceback, nothing half-written) for bad input."""
from __future__ import annotations

import shutil
import subprocess as sp
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import HPRUNE, SMALL_DATA, hprune


def assert_one_line_error(proc: sp.CompletedProcess, *expected: str, status: int = 2) -> str:
    """One line on stderr naming the problem, with `status` (2: bad input; 3: a job or worker failed)."""
    assert proc.returncode == status, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hprune") and "error:" in line]
    assert len(errors) == 1, proc.stderr[-2000:]
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


def test_help_lists_verbs_quickly():
    hprune("--help")  # warm the file cache
    started = time.perf_counter()
    proc = sp.run([str(Path(sys.executable).parent / "hprune"), "--help"], capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    assert proc.returncode == 0
    for verb in ("train", "eval", "data", "prune", "report"):
        assert f"  {verb} " in proc.stdout
    assert elapsed < 1.5, elapsed


def test_verb_help_is_hydras():
    proc = hprune("train", "--help")
    assert ("model: moa_8k16e128d, moa_8k32e128d, moa_base, moa_big, moa_tiny, transformer_base, transformer_big, "
            "transformer_iwslt_de_en, transformer_small, transformer_tiny") in proc.stdout
    proc = hprune("train", "--cfg", "job", "model=transformer_base")
    assert "encoder_embed_dim: 512" in proc.stdout


def test_unknown_verb():
    assert_one_line_error(hprune("trian", check=False, subprocess=True), "unknown verb 'trian'", "train, eval, data")


def test_report_without_folders():
    assert_one_line_error(hprune("report", check=False), "which runs? give their folder(s)")


def test_unknown_group_option_lists_valid_ones():
    assert_one_line_error(hprune("train", "model=transformer_huge", check=False, subprocess=True),
                          "unknown model 'transformer_huge'",
                          "transformer_base, transformer_big, transformer_iwslt_de_en, transformer_small, transformer_tiny")
    assert_one_line_error(hprune("train", "-m", "model=transformer_tiny,nope", check=False), "unknown model 'nope'")


def test_malformed_override():
    assert_one_line_error(hprune("train", "optim.lr=[0.1,", check=False), "malformed override 'optim.lr=[0.1,'")


def test_unknown_key():
    assert_one_line_error(hprune("train", "optim.lrr=0.1", check=False), "optim.lrr", "--help")


def test_unknown_data_action():
    assert_one_line_error(hprune("data", "unpack", check=False), "unknown action 'unpack'", "prepare", "fetch")


def eval_error(ckpt: Path, tmp_path: Path, *extra: str, data=SMALL_DATA, subprocess: bool = False
               ) -> sp.CompletedProcess:
    out = tmp_path / "eval"
    proc = hprune("eval", f"ckpt={ckpt}", f"hydra.run.dir={out}", *data, "device=cpu", *extra, check=False,
                  subprocess=subprocess)
    assert not (out / "metrics.json").exists() and not list(out.glob("hypotheses*"))
    return proc


def test_missing_checkpoint(tmp_path):
    assert_one_line_error(eval_error(tmp_path / "nope.pt", tmp_path, subprocess=True), "does not exist")


def test_truncated_checkpoint(trained_run, tmp_path):
    ckpt = tmp_path / "cut.pt"
    data = (trained_run / "checkpoints" / "checkpoint_best.pt").read_bytes()
    ckpt.write_bytes(data[: len(data) // 3])
    assert_one_line_error(eval_error(ckpt, tmp_path), "truncated")


def test_unsafe_checkpoint_is_refused_and_not_run(tmp_path):
    from test_safe_load import RunsCommandOnLoad

    marker, ckpt = tmp_path / "pwned", tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": RunsCommandOnLoad(marker)}, ckpt)
    assert_one_line_error(eval_error(ckpt, tmp_path), "refusing to load")
    assert not marker.exists()


def test_checkpoint_of_another_architecture(trained_run, tmp_path):
    state = torch.load(trained_run / "checkpoints" / "checkpoint_best.pt", weights_only=False)
    state["cfg"]["model"].arch = state["cfg"]["model"]._name = "lstm"
    torch.save(state, tmp_path / "lstm.pt")
    assert_one_line_error(eval_error(tmp_path / "lstm.pt", tmp_path), "'lstm' model, which hprune cannot run",
                          "fairseq translation Transformers (transformer, ")


def test_checkpoint_of_another_task_is_refused_by_the_task_name(trained_run, tmp_path):
    state = torch.load(trained_run / "checkpoints" / "checkpoint_best.pt", weights_only=False)
    state["cfg"]["task"]["_name"] = "translation_multi_simple_epoch"
    torch.save(state, tmp_path / "multi.pt")
    assert_one_line_error(eval_error(tmp_path / "multi.pt", tmp_path), "'translation_multi_simple_epoch' task",
                          "not translation")


def test_a_checkpoint_without_languages_whose_direction_nothing_says(trained_run, tmp_path):
    """fairseq-train without -s/-t records no languages: with data=pretrained and no data-bin of its own, the
    dictionaries beside it must say which side is which; joined ones (the same size) cannot."""
    state = torch.load(trained_run / "checkpoints" / "checkpoint_best.pt", weights_only=False)
    state["cfg"]["task"].update(source_lang=None, target_lang=None, data=str(tmp_path / "gone"))
    folder = tmp_path / "model"
    folder.mkdir()
    torch.save(state, folder / "model.pt")
    trained_on = Path(torch.load(trained_run / "checkpoints" / "checkpoint_best.pt", weights_only=False)["cfg"]["task"]["data"])
    for lang in ("src", "tgt"):  # the synthetic task's joined dictionaries
        shutil.copy(trained_on / f"dict.{lang}.txt", folder / f"dict.{lang}.txt")
    (folder / "bpecodes").write_text("")
    proc = hprune("eval", f"ckpt={folder / 'model.pt'}", f"hydra.run.dir={tmp_path / 'eval'}", "data=pretrained",
                  "device=cpu", check=False)
    assert_one_line_error(proc, "records no languages", "dict.src.txt, dict.tgt.txt", "data.src_lang=")


def test_checkpoint_of_another_vocabulary(trained_run, tmp_path):
    other = [o for o in SMALL_DATA if "n_names" not in o] + ["data.params.n_names=30"]
    assert_one_line_error(eval_error(trained_run, tmp_path, data=other), "vocabulary differs")


def test_checkpoint_of_another_vocabulary_whose_data_is_gone(trained_run, tmp_path):
    """Without the training data at hand, the embedding size still tells a different vocabulary."""
    state = torch.load(trained_run / "checkpoints" / "checkpoint_best.pt", weights_only=False)
    state["cfg"]["task"]["data"] = str(tmp_path / "moved")
    torch.save(state, tmp_path / "moved.pt")
    other = [o for o in SMALL_DATA if "n_names" not in o] + ["data.params.n_names=30"]
    assert_one_line_error(eval_error(tmp_path / "moved.pt", tmp_path, data=other), "words but", "dict.src.txt",
                          "the dictionaries are not this model")


def test_checkpoint_with_mismatched_shapes(trained_run, tmp_path):
    state = torch.load(trained_run / "checkpoints" / "checkpoint_best.pt", weights_only=False)
    state["model"]["encoder.layers.0.fc1.weight"] = torch.zeros(3, 3)
    torch.save(state, tmp_path / "bad.pt")
    assert_one_line_error(eval_error(tmp_path / "bad.pt", tmp_path), "does not match its declared architecture")


def test_unwritable_data_dir(trained_run, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_one_line_error(eval_error(trained_run, tmp_path, f"paths.data_root={blocker}/sub"),
                          f"cannot create {blocker}/sub", "paths.data_root")


def test_missing_split_in_data_dir(trained_run, tmp_path, data_root):
    copy = tmp_path / "data"
    shutil.copytree(data_root, copy)
    for f in copy.glob("toy-*/bin/test.*"):
        f.unlink()
    assert_one_line_error(eval_error(trained_run, tmp_path, f"paths.data_root={copy}"), "hprune data prepare")


def test_empty_test_set(trained_run, tmp_path):
    data = [o for o in SMALL_DATA if "n_test" not in o] + ["data.params.n_test=0"]
    assert_one_line_error(eval_error(trained_run, tmp_path, data=data), "empty")


@pytest.mark.parametrize("bad", ["device=tpu", "precision=fp8"])
def test_bad_device_or_precision(trained_run, tmp_path, bad):
    assert_one_line_error(eval_error(trained_run, tmp_path, bad), bad.split("=")[0])


def test_shell_completion_routes_to_the_verb():
    import os
    env = {**os.environ, "COMP_LINE": "hprune tr", "COMP_POINT": "9"}
    proc = sp.run([*HPRUNE, "-sc", "query=bash"], capture_output=True, text=True, env=env)
    assert proc.stdout.split() == ["train"]
    env.update(COMP_LINE="hprune train mod", COMP_POINT="16")
    proc = sp.run([*HPRUNE, "-sc", "query=bash"], capture_output=True, text=True, env=env)
    assert "model=" in proc.stdout.split(), proc.stdout + proc.stderr
    env.update(COMP_LINE="hprune train model=transformer_b", COMP_POINT="31")
    proc = sp.run([*HPRUNE, "-sc", "query=bash"], capture_output=True, text=True, env=env)
    assert "model=transformer_base" in proc.stdout.split(), proc.stdout + proc.stderr
    proc = sp.run([*HPRUNE, "-sc", "install=bash"], capture_output=True, text=True)
    assert "complete -o nospace -o default -F hydra_bash_completion hprune" in proc.stdout


def test_multirun_sweep_writes_one_run_dir_per_job(tmp_path):
    sweep = tmp_path / "sweep"
    hprune("train", "-m", "seed=1,2", f"hydra.sweep.dir={sweep}", *SMALL_DATA, "optim.max_update=3",
           "optim.max_tokens=1024", "device=cpu")
    import json
    seeds = sorted(json.loads((sweep / str(job) / "metrics.json").read_text())["seed"] for job in (0, 1))
    assert seeds == [1, 2]
    assert (sweep / "multirun.yaml").is_file()


def test_half_precision_training_needs_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = hprune("train", f"hydra.run.dir={tmp_path}", *SMALL_DATA, "device=cpu", "precision=bf16", check=False)
    assert_one_line_error(proc, "precision=bf16 needs a CUDA device for training")
    assert not (tmp_path / "checkpoints").exists()


def test_eval_without_a_checkpoint_names_the_setting(tmp_path):
    """A mandatory value left out is one line naming it and an example (the verb wrapper), not Hydra's hint."""
    proc = hprune("eval", f"hydra.run.dir={tmp_path}", "device=cpu", check=False, subprocess=True)
    assert_one_line_error(proc, "which model? pass ckpt=")
    assert not (tmp_path / "metrics.json").exists()


def test_bad_beam_is_refused_before_any_translation(trained_run, tmp_path):
    assert_one_line_error(eval_error(trained_run, tmp_path, "generation.beam=0"), "generation.beam=0 must be a whole number >= 1")


@pytest.mark.parametrize("extra, expected", [
    (["data.params.n_train=0"], "data.params.n_train=0 must be a whole number >= 1"),
    (["model.encoder_layers=-1"], "model.encoder_layers=-1 must be a positive whole number"),
    (["optim.max_update=0"], "optim.max_update=0 is not a positive number of updates (fairseq would read 0 as 'no limit'"),
    (["optim.max_update=null"], "optim.max_update and optim.max_epoch are both null"),
])
def test_bad_training_settings_are_refused_before_training(tmp_path, extra, expected):
    proc = hprune("train", f"hydra.run.dir={tmp_path}", *SMALL_DATA, "device=cpu", *extra, check=False)
    assert_one_line_error(proc, expected)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.json").exists()


def test_console_shows_stage_lines_and_the_log_keeps_everything(trained_run, tmp_path):
    """A run's terminal output is its stage lines and results; fairseq's records (config dumps, loading) are in
    <verb>.log only, and on the terminal too with verbose=true."""
    def run(name: str, *extra: str):
        out = tmp_path / name
        proc = hprune("eval", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu", *extra,
                      subprocess=True)
        return (proc.stdout + proc.stderr).splitlines(), (out / "eval.log").read_text()

    quiet, log = run("quiet")
    assert any(line.startswith("BLEU ") for line in quiet) and len(quiet) <= 8, quiet
    assert not [line for line in quiet if "fairseq" in line or "Namespace(" in line], quiet
    assert "[fairseq." in log and "[hprune.session][INFO] - model" in log  # everything is in the log file
    loud, _ = run("verbose", "verbose=true")
    assert any("[fairseq." in line for line in loud) and len(loud) > len(quiet)


def test_a_sweep_sent_to_slurm_without_slurm_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # python, hprune; no sbatch, no srun
    proc = hprune("train", "-m", "seed=1,2", "hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                  check=False, subprocess=True)
    assert_one_line_error(proc, "hydra/launcher=slurm", "no sbatch or srun on PATH", "hydra/launcher=local")
    assert not (tmp_path / "sweep").exists()
    # with SLURM's commands on PATH the launcher is let through (a stand-in for each)
    from hprune_cli.checks import check_launcher
    for command in ("sbatch", "srun"):
        (tmp_path / command).write_text("#!/bin/sh\n")
        (tmp_path / command).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{Path(sys.executable).parent}")
    assert check_launcher(["-m", "seed=1,2", "hydra/launcher=slurm"]) is None
    assert check_launcher(["seed=1", "hydra/launcher=slurm"]) is None  # a single run ignores the launcher
