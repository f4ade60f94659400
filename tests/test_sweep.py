"""Sweep tables: hand-made job dirs against hand-written rows, and a real multirun."""
from __future__ import annotations

import json

import pandas as pd

from conftest import SMALL_DATA, hprune
from hprune.reporting.sweep import sweep_rows, write_table


def job(root, name, overrides, metrics=None):
    (root / name / ".hydra").mkdir(parents=True)
    (root / name / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if metrics is not None:
        (root / name / "metrics.json").write_text(json.dumps(metrics))


def test_rows_follow_the_jobs_and_incomplete_jobs_are_listed(tmp_path, capsys):
    for i, lam in enumerate([0.01, 0.03, 0.1]):
        job(tmp_path, str(i), ["prune=voita", f"prune.l0_lambda={lam}"],
            {"method": "voita", "kept_enc_self": 12 - 3 * i, "bleu": 90.0 - i, "delta_bleu": -float(i), "seed": 1})
    job(tmp_path, "3", ["prune=voita", "prune.l0_lambda=0.3"])  # killed before metrics.json
    job(tmp_path, "10", ["prune=voita", "prune.l0_lambda=1.0"], {"method": "voita", "kept_enc_self": 0, "bleu": 50.0})
    table, incomplete, _ = sweep_rows(tmp_path)
    assert incomplete == ["3"]
    assert list(table["job"]) == ["0", "1", "2", "10"]  # numeric order, not 0, 1, 10, 2
    assert list(table["prune.l0_lambda"]) == ["0.01", "0.03", "0.1", "1.0"]
    assert list(table["kept_enc_self"]) == [12, 9, 6, 0] and "seed" not in table
    written = write_table(tmp_path)
    assert "prune" not in written  # the same in every job
    assert pd.read_csv(tmp_path / "sweep.csv")["bleu"].tolist() == [90.0, 89.0, 88.0, 50.0]
    assert "| 0.03 |" in " ".join((tmp_path / "sweep.md").read_text().split())
    assert "incomplete jobs (no metrics.json): 3" in capsys.readouterr().out


def test_a_multirun_ends_with_its_table(trained_run, tmp_path):
    hprune("eval", "-m", f"ckpt={trained_run}", f"hydra.sweep.dir={tmp_path}", *SMALL_DATA, "device=cpu",
           "generation.beam=1,2")
    table = pd.read_csv(tmp_path / "sweep.csv")
    runs = [json.loads((tmp_path / str(i) / "metrics.json").read_text()) for i in range(2)]
    assert table["generation.beam"].tolist() == [1, 2]
    assert table["bleu"].tolist() == [r["bleu"] for r in runs]
