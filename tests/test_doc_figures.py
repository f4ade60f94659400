"""scripts/doc_figures.py writes a page's figure sections from runs, and its check fails where a page and the
runs disagree beyond the section's spread."""
from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "doc_figures.py"


def figures(page, runs, *flags) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--runs", str(runs), "--pages", str(page), *flags],
                          capture_output=True, text=True)


def test_sections_written_from_runs_and_checked_against_them(tmp_path):
    report = tmp_path / "demo" / "report"
    report.mkdir(parents=True)
    pd.DataFrame([{"run": "demo/voita/0", "l0_lambda": 0.0, "kept_heads": 12, "bleu": 99.8, "delta_bleu": -0.2},
                  {"run": "demo/voita/1", "l0_lambda": 1.0, "kept_heads": 9, "bleu": 93.43, "delta_bleu": -6.57,
                   "delta_bleu_control": -6.37, "p_vs_control": 0.001}]).to_csv(report / "controlled.csv", index=False)
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- figures:demo-controlled -->\nstale 1.0\n<!-- /figures:demo-controlled -->\nafter\n")
    assert figures(page, tmp_path).returncode == 0
    text = page.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "stale" not in text
    assert "93.43" in text and "-6.37" in text and "0.001" in text and "1 (control)" not in text
    assert figures(page, tmp_path, "--check").returncode == 0
    page.write_text(text.replace("93.43", "88.00"))  # 5.43 from the run: beyond the section's ±5
    checked = figures(page, tmp_path, "--check")
    assert checked.returncode == 1 and "demo-controlled" in checked.stderr and "88 vs 93.43" in checked.stderr
    page.write_text(text.replace("93.43", "90.00"))  # within the spread
    assert figures(page, tmp_path, "--check").returncode == 0
    (report / "controlled.csv").unlink()
    missing = figures(page, tmp_path, "--check")
    assert missing.returncode == 1 and "no runs to make it from" in missing.stderr


def test_a_section_of_runs_the_docs_check_does_not_make_is_left_as_it_is_without_them(tmp_path):
    """The real-language study (scripts/study_real.sh) takes hours: without its runs, its sections stay as they
    are and the check passes; the demo's sections still fail without theirs."""
    page = tmp_path / "page.md"
    body = "<!-- figures:real-summary -->\nBLEU 12.34\n<!-- /figures:real-summary -->\n"
    page.write_text(body)
    checked = figures(page, tmp_path, "--check")
    assert checked.returncode == 0 and "real-summary: left as it is" in checked.stderr
    assert figures(page, tmp_path).returncode == 0 and page.read_text() == body
    page.write_text(body + "<!-- figures:demo-controlled -->\n1.0\n<!-- /figures:demo-controlled -->\n")
    assert figures(page, tmp_path, "--check").returncode == 1


def test_each_section_says_which_commit_its_runs_were_made_with_and_a_stale_one_is_seen(tmp_path):
    """A section ends with the commit of its runs (metrics.json's git_sha); the check fails where the page's
    commit is not the runs', and says how many commits since then changed the code the runs ran."""
    report = tmp_path / "demo" / "report"
    report.mkdir(parents=True)
    pd.DataFrame([{"run": "demo/voita/0", "l0_lambda": 0.0, "kept_heads": 12, "bleu": 99.8, "delta_bleu": -0.2}]
                 ).to_csv(report / "controlled.csv", index=False)
    run = tmp_path / "demo" / "voita" / "0"
    run.mkdir(parents=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    (run / "metrics.json").write_text(json.dumps({"git_sha": head}))
    page = tmp_path / "page.md"
    page.write_text("<!-- figures:demo-controlled -->\n1.0\n<!-- /figures:demo-controlled -->\n")
    assert figures(page, tmp_path).returncode == 0
    assert f"Figures from runs of commit {head[:10]} (outputs/demo, " in page.read_text()
    assert figures(page, tmp_path, "--check").returncode == 0  # the sha's digits are no figures
    old = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.split()[-1]  # the first commit: the code has changed since
    (run / "metrics.json").write_text(json.dumps({"git_sha": old}))
    checked = figures(page, tmp_path, "--check")
    assert checked.returncode == 1 and f"from runs of commit {head[:10]}, the runs are of {old[:10]}" in checked.stderr
    assert figures(page, tmp_path).returncode == 0 and old[:10] in page.read_text()
    checked = figures(page, tmp_path, "--check")
    assert checked.returncode == 0 and f"since {old[:10]} changed the code these runs ran" in checked.stderr


def test_the_demos_expected_ranges_are_the_spread_of_its_figures_over_seeds(tmp_path):
    """scripts/demo_expected.json is written from the demo's own settings run on each seed's model: mean ± 3 sd,
    rounded outward to 0.1 (BLEU at most 100); Michel against random a claim only where it won in every seed."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("doc_figures", SCRIPT)
    doc_figures = importlib.util.module_from_spec(spec)
    sys.modules["doc_figures"] = doc_figures  # (its dataclasses look their module up)
    spec.loader.exec_module(doc_figures)
    figures_by_seed = {1: (100.0, -0.56, 30.1), 2: (99.88, 0.01, 40.2), 3: (100.0, -1.51, 35.3)}
    for seed, (bleu, change, without) in figures_by_seed.items():
        for run, metrics in (("control", {"bleu_unpruned": bleu, "delta_bleu": change}),
                             ("no_enc_self", {"bleu": bleu - without})):
            (tmp_path / "study_demo" / str(seed) / run).mkdir(parents=True)
            (tmp_path / "study_demo" / str(seed) / run / "metrics.json").write_text(json.dumps(metrics))
    (tmp_path / "study" / "report").mkdir(parents=True)
    pd.DataFrame({"method": ["michel"] * 3, "versus": ["random"] * 3, "sparsity": [25, 50, 75],
                  "significant": ["2/3", "3/3", "3/3"]}).to_csv(tmp_path / "study" / "report" / "pairwise_seeds.csv")
    expected = doc_figures.demo_expected(tmp_path)
    changes = pd.Series([-0.56, 0.01, -1.51])
    low, high = changes.mean() - 3 * changes.std(), changes.mean() + 3 * changes.std()  # -2.97, +1.63
    assert expected["ranges"]["control_change"] == [-3.0, 1.7] and -3.0 <= low and high <= 1.7
    assert expected["ranges"]["unpruned_bleu"][1] == 100.0 and expected["ranges"]["unpruned_bleu"][0] < 99.88
    assert expected["ranges"]["enc_self_removed_drop"] == [20.0, 50.4]  # 35.2 ± 3 × 5.05
    assert expected["ranges"]["michel_beats_random_25"] == [0, 1] and expected["ranges"]["michel_beats_random_50"] == [1, 1]
    # the file the demo's summary reads has every figure it compares
    on_file = json.loads((ROOT / "scripts" / "demo_expected.json").read_text())["ranges"]
    assert set(on_file) == set(expected["ranges"])
