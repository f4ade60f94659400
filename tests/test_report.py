"""`hprune report`: tables from hand-made run dirs against hand-computed values, files written, bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import hprune
from hprune.errors import UserError
from hprune.reporting import tables
from hprune.reporting.collect import collect, run_dirs

CKPT = "/runs/base/checkpoints/checkpoint_best.pt"


def run_dir(root: Path, name: str, verb: str, metrics: dict | None, overrides=(), config=None, curve=None) -> Path:
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    config = {"verb": verb, "split": "test", "data": {"name": "toy", "src_lang": "src", "tgt_lang": "tgt"},
              "generation": {"beam": 5, "lenpen": 1.0}, **(config or {})}
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    if metrics is not None:
        from hprune.methods import METHODS, method_names
        if verb == "prune" and metrics.get("method") in method_names():  # what the prune verb adds, as it does
            metrics = {**METHODS[metrics["method"]].report.fields(), **metrics}
        (run / "metrics.json").write_text(json.dumps(metrics))
    if curve is not None:
        pd.DataFrame(curve, columns=["order", "pct_pruned", "bleu"]).to_csv(run / "curve.csv", index=False)
    return run


def controlled(key: str, control: bool, label: str = "λ=0 control") -> dict:
    """What a trained method's run records in metrics.json to be paired with its control (methods: Control)."""
    return {"control_key": key, "is_control": control, "control_label": label}


def study(root: Path) -> None:
    """A Michel curve with a random baseline, three Voita runs (λ sweep), an MoA and a dense eval, one killed run."""
    types = ["enc-self", "dec-self", "dec-enc"]
    pruned = {"verb": "prune", "checkpoint": CKPT, "types": types, "heads_pool": 36, "bleu_unpruned": 30.0}
    run_dir(root, "michel", "prune", {**pruned, "method": "michel", "pct_pruned": 20.0, "bleu": 29.0},
            curve=[("michel", 0.0, 30.0), ("michel", 20.0, 29.0), ("michel", 40.0, 25.0), ("michel", 60.0, 15.0),
                   ("michel", 80.0, 5.0), ("random", 0.0, 30.0), ("random", 20.0, 26.0), ("random", 40.0, 18.0),
                   ("random", 60.0, 8.0), ("random", 80.0, 2.0)])
    for job, (lam, kept, bleu) in enumerate([(0.01, 27, 29.5), (0.1, 18, 28.0), (1.0, 9, 20.0)]):
        run_dir(root / "sweep", str(job), "prune", {**pruned, "method": "voita", "l0_lambda": lam,
                                                     "kept_heads": kept, "pct_pruned": 100 * (36 - kept) / 36,
                                                     "bleu": bleu, "delta_bleu": bleu - 30.0, **controlled("v", False)},
                overrides=[f"prune.l0_lambda={lam}"])
    run_dir(root / "sweep", "3", "prune", None, overrides=["prune.l0_lambda=3.0"])  # killed: no metrics.json
    moa = run_dir(root, "moa", "eval", {"verb": "eval", "moa_experts": 8, "moa_top_k": 4, "moa_head_dim": 24,
                                        "n_params": 500, "macs_per_token": 900, "bleu": 31.0})
    pd.DataFrame([{"type": "enc-self", "layer": layer, "expert": e, "share": 1 / 8} for layer in range(2)
                  for e in range(8)]).to_csv(moa / "expert_load.csv", index=False)
    run_dir(root, "dense", "eval", {"verb": "eval", "n_params": 400, "macs_per_token": 900, "bleu": 30.0})
    run_dir(root, "report", "report", None)  # an earlier report: not a run, not incomplete


def test_tables_equal_hand_computed_values(tmp_path):
    study(tmp_path)
    collection = collect([tmp_path])
    assert collection.incomplete == [(f"{tmp_path.name}/sweep/3", "no metrics.json (failed, killed or still running)")]
    table = tables.comparison(collection, [25, 50, 75]).set_index("method")
    # michel: 29 + (25-20)/20 * (25-29) = 28; 50 % -> 20; 75 % -> 7.5.  random: 24, 13, 3.5
    assert table.loc["michel", ["BLEU@25%", "BLEU@50%", "BLEU@75%"]].tolist() == pytest.approx([28.0, 20.0, 7.5])
    assert table.loc["random", ["BLEU@25%", "BLEU@50%", "BLEU@75%"]].tolist() == pytest.approx([24.0, 13.0, 3.5])
    assert table.loc["random", "ΔBLEU@50%"] == pytest.approx(-17.0)
    # voita points at 25, 50, 75 % pruned: exactly 29.5, 28.0, 20.0; nothing is extrapolated
    assert table.loc["voita", ["BLEU@25%", "BLEU@50%", "BLEU@75%"]].tolist() == pytest.approx([29.5, 28.0, 20.0])
    assert pd.isna(tables.comparison(collection, [90]).set_index("method").loc["voita", "BLEU@90%"])
    lambdas = tables.controlled(collection)
    assert lambdas["l0_lambda"].tolist() == [0.01, 0.1, 1.0] and lambdas["kept_heads"].tolist() == [27, 18, 9]
    moa = tables.moa(collection)
    assert moa[["E", "k", "params", "bleu"]].fillna(-1).values.tolist() == [[-1, -1, 400, 30.0], [8, 4, 500, 31.0]]
    grouped = tables.runs_table(collection, ["bleu"], ["verb"]).set_index("verb")
    assert grouped.loc["prune", "runs"] == 4 and grouped.loc["prune", "bleu"] == pytest.approx((29 + 29.5 + 28 + 20) / 4)


def test_a_per_stack_run_is_its_own_method_beside_the_free_one(tmp_path):
    """The same order on the same model in two layouts: two rows, each from its own points; and a fisher run's
    layout from its metrics."""
    study(tmp_path)
    pruned = {"verb": "prune", "checkpoint": CKPT, "types": ["enc-self", "dec-self", "dec-enc"], "heads_pool": 36,
              "bleu_unpruned": 30.0}
    run = run_dir(tmp_path, "michel_per_stack", "prune", {**pruned, "method": "michel", "layout": "per_stack",
                                                          "pct_pruned": 25.0, "bleu": 28.0})
    pd.DataFrame([("michel", "per_stack", 0.0, 30.0), ("michel", "per_stack", 25.0, 28.0),
                  ("michel", "per_stack", 50.0, 22.0)], columns=["order", "layout", "pct_pruned", "bleu"]
                 ).to_csv(run / "curve.csv", index=False)
    run_dir(tmp_path, "fisher", "prune", {**pruned, "method": "fisher", "layout": "per_stack", "pct_pruned": 50.0,
                                          "bleu": 21.0, "macs_budget": 0.5, "attention_macs_pct": 50.0})
    table = tables.comparison(collect([tmp_path]), [25, 50]).set_index("method")
    assert table.loc["michel", "BLEU@50%"] == pytest.approx(20.0)  # the free curve alone (study's)
    assert table.loc["michel (per_stack)", ["BLEU@25%", "BLEU@50%"]].tolist() == pytest.approx([28.0, 22.0])
    assert table.loc["fisher (per_stack)", "BLEU@50%"] == pytest.approx(21.0)


def test_only_runs_that_differ_in_the_seed_alone_are_averaged_as_seeds(tmp_path):
    """A λ sweep's control (λ = 0) and a λ that pruned nothing sit at the same 0 %: two settings, two points. The
    same λ with seeds 1 and 2: one point, their mean, counted as 2 seeds."""
    from hprune.reporting.plots import curve_points
    pruned = {"verb": "prune", "checkpoint": CKPT, "types": ["enc-self"], "heads_pool": 12, "bleu_unpruned": 30.0,
              "method": "voita"}
    for name, lam, seed, pct, bleu in (("control", 0.0, 1, 0.0, 31.0), ("small", 1.0, 1, 0.0, 29.0),
                                       ("large_1", 4.0, 1, 50.0, 20.0), ("large_2", 4.0, 2, 50.0, 22.0)):
        run_dir(tmp_path, name, "prune", {**pruned, "l0_lambda": lam, "pct_pruned": pct, "bleu": bleu},
                config={"seed": seed, "prune": {"method": "voita", "l0_lambda": lam}})
    points = curve_points(tables.pruning_points(collect([tmp_path])))
    assert points[["pct_pruned", "mean", "count"]].values.tolist() == [[0.0, 29.0, 1], [0.0, 31.0, 1],
                                                                       [50.0, 21.0, 2]] or \
        points[["pct_pruned", "mean", "count"]].values.tolist() == [[0.0, 31.0, 1], [0.0, 29.0, 1], [50.0, 21.0, 2]]


def test_dsp_against_its_control_and_a_budgeted_run_at_matched_macs(tmp_path):
    types = ["enc-self", "dec-self", "dec-enc"]
    pruned = {"verb": "prune", "checkpoint": CKPT, "types": types, "heads_pool": 36, "bleu_unpruned": 30.0}
    michel = run_dir(tmp_path, "michel", "prune", {**pruned, "method": "michel", "pct_pruned": 25.0, "bleu": 28.0})
    pd.DataFrame([("michel", step, pct, macs, bleu) for step, (pct, macs, bleu) in
                  enumerate([(0.0, 100.0, 30.0), (25.0, 74.0, 28.0), (50.0, 49.0, 20.0), (75.0, 24.0, 8.0)])],
                 columns=["order", "step", "pct_pruned", "attention_macs_pct", "bleu"]).to_csv(michel / "curve.csv",
                                                                                              index=False)
    training = {"ckpt": CKPT, "seed": 1, "prune": {"method": "dsp", "types": types, "optim": {"lr": 0.001}, "joint": True}}
    for name, budget, pct, macs, bleu in (("dsp18", 18, 50.0, 49.0, 29.0), ("dsp36", 36, 0.0, 100.0, 30.5)):
        config = {**training, "prune": {**training["prune"], "head_budget": budget}}
        run_dir(tmp_path, name, "prune", {**pruned, "method": "dsp", "head_budget": budget,
                                          **controlled("d", budget == 36, "K=all control"),
                                          "pct_pruned": pct, "attention_macs_pct": macs, "bleu": bleu}, config=config)
    run_dir(tmp_path, "fisher", "prune", {**pruned, "method": "fisher", "macs_budget": 0.5, "pct_pruned": 52.78,
                                          "attention_macs_pct": 47.0, "bleu": 25.0})
    collection = collect([tmp_path])
    table = tables.comparison(collection, [50]).set_index("method")
    # DSP at K = 18 against its control, the same training keeping every head: 29 - 30.5
    assert table.loc["dsp", "reference"] == "K=all control" and table.loc["dsp", "ΔBLEU@50%"] == pytest.approx(-1.5)
    assert table.loc["michel", "reference"] == "unpruned"
    macs = tables.matched_macs(collection)
    assert len(macs) == 1 and macs["run"].iloc[0].endswith("fisher")
    row = macs.iloc[0]
    # at the 47 % of attention MACs fisher reached: michel's curve between (49, 20) and (24, 8): 20 - 2 · 12/25;
    # DSP's point at 49 % is within 2.5 points of it
    assert row["attention MACs kept %"] == 47.0 and row["fisher"] == 25.0
    assert row["michel"] == pytest.approx(20 - 2 * 12 / 25) and row["dsp"] == 29.0


def test_numbered_and_named_folders_side_by_side(tmp_path):
    """Sweep jobs (1, 2, 10) next to a named folder at the same depth: numbers in numeric order, then names."""
    for name in ("10", "2", "report", "1"):
        run_dir(tmp_path, name, "eval", {"verb": "eval", "bleu": 1.0})
    assert [p.name for p in run_dirs([tmp_path])] == ["1", "2", "10", "report"]


def test_markdown_and_latex_text():
    table = pd.DataFrame({"method": ["a_b"], "heads": [3.0], "BLEU@25%": [float("nan")], "ΔBLEU": [-1.234]})
    lines = [" ".join(line.split()) for line in tables.markdown(table).splitlines()]
    assert lines[0] == "| method | heads | BLEU@25% | ΔBLEU |" and lines[2] == "| a_b | 3 | | -1.23 |"
    assert lines[1].startswith("|:-") and lines[1].endswith("-:|")  # text left, numbers right
    assert r"a\_b & 3 &  & -1.23 \\" in tables.latex(table)
    assert r"BLEU@25\% & $\Delta$BLEU" in tables.latex(table)


def test_incompatible_runs_and_unknown_columns_are_refused(tmp_path):
    study(tmp_path)
    run_dir(tmp_path, "valid-michel", "prune", {"verb": "prune", "checkpoint": CKPT, "method": "random",
                                                "types": ["enc-self", "dec-self", "dec-enc"], "pct_pruned": 50.0,
                                                "bleu": 10.0}, config={"split": "valid"})
    collection = collect([tmp_path])
    with pytest.raises(UserError, match=r"scored with different split \(test vs valid\).*group_by=\[split\]"):
        tables.comparison(collection, [50])
    by_split = tables.comparison(collection, [50], group_by=["split"])
    assert set(by_split["split"]) == {"test", "valid"}
    with pytest.raises(UserError, match="unknown column 'blue'; the runs have: .*bleu"):
        tables.runs_table(collection, ["blue"], [])
    with pytest.raises(UserError, match="no finished hprune runs under .* \\(1 incomplete\\)"):
        collect([tmp_path / "sweep" / "3"])


def test_report_cli_writes_tables_plots_and_lists_incomplete_runs(tmp_path):
    study(tmp_path / "runs")
    out = tmp_path / "report"
    proc = hprune("report", str(tmp_path / "runs"), f"hydra.run.dir={out}", subprocess=True)
    assert "| michel |" in " ".join(proc.stdout.split()) and "incomplete runs (1): runs/sweep/3" in proc.stdout
    for name in ("comparison", "controlled", "moa", "runs"):
        for fmt in ("csv", "md", "tex"):
            assert (out / f"{name}.{fmt}").stat().st_size > 0
    assert pd.read_csv(out / "comparison.csv").set_index("method").loc["michel", "BLEU@50%"] == pytest.approx(20.0)
    pngs, pdfs = sorted((out / "plots").glob("*.png")), sorted((out / "plots").glob("*.pdf"))
    assert len(pngs) == len(pdfs) >= 3  # BLEU vs % pruned, BLEU and heads vs λ, expert load
    assert (out / "plots" / "runs_moa_share.png").exists()
    assert all(p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 5000 for p in pngs)
    assert all(p.read_bytes()[:4] == b"%PDF" for p in pdfs)
    assert (out / "incomplete.txt").read_text() == "runs/sweep/3: no metrics.json (failed, killed or still running)\n"
    report = (out / "report.md").read_text()
    assert "## Pruning methods at matched sparsity" in report and "](plots/" in report


@pytest.mark.parametrize("args, message", [
    (["EMPTY"], "no finished hprune runs under"),
    (["RUNS", "columns=[blue]"], "unknown column 'blue'"),
    (["MISSING"], "is not a folder"),
    (["RUNS", "MIXED"], "scored with different split (test vs valid)"),
])
def test_bad_input_is_one_line(tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    study(tmp_path / "runs")
    run_dir(tmp_path / "mixed", "valid-random", "prune", {"verb": "prune", "checkpoint": CKPT, "method": "random",
                                                         "types": ["enc-self", "dec-self", "dec-enc"],
                                                         "pct_pruned": 50.0, "bleu": 10.0}, config={"split": "valid"})
    paths = {"EMPTY": str(tmp_path / "empty"), "RUNS": str(tmp_path / "runs"), "MISSING": str(tmp_path / "nope"),
             "MIXED": str(tmp_path / "mixed")}
    proc = hprune("report", *[paths.get(a, a) for a in args], f"hydra.run.dir={tmp_path / 'out'}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1]


def sacrebleu_paired(tmp_path: Path, references: list, baseline: list, system: list, resamples: int, seed: int) -> dict:
    """sacrebleu --paired-bs on files: the system's entry (score, p_value)."""
    from test_significance import sacrebleu_cli
    return sacrebleu_cli(tmp_path, references, baseline, system, resamples, seed)[1]["BLEU"]


def translated_run(root: Path, name: str, hypotheses: dict, references: list, **kwargs) -> Path:
    run = run_dir(root, name, "prune", **kwargs)
    for hyp_name, lines in hypotheses.items():
        (run / "hypotheses").mkdir(exist_ok=True)
        (run / "hypotheses" / f"{hyp_name}.txt").write_text("".join(line + "\n" for line in lines))
    (run / "references.txt").write_text("".join(line + "\n" for line in references))
    return run


def test_significance_controls_and_seeds_in_the_report(tmp_path):
    """p-values as sacrebleu --paired-bs gives them on the saved files; Voita runs against their λ = 0 control;
    two train seeds of one recipe aggregated to mean and standard deviation."""
    from test_significance import corpus, degrade
    references = corpus(1, 80)
    start, michel, rand = degrade(references, 4, 2), degrade(references, 3, 3), degrade(references, 1, 4)
    types = ["enc-self", "dec-self", "dec-enc"]
    bleus = {}
    for seed in (1, 2):  # two train runs of one recipe, seeds 1 and 2
        train = run_dir(tmp_path / "train", str(seed), "train", {"bleu": 1.0}, config={"seed": seed, "model": {"d": 1}})
        ckpt = str(train / "checkpoints" / "checkpoint_best.pt")
        prune = {"verb": "prune", "checkpoint": ckpt, "types": types, "heads_pool": 36, "bleu_unpruned": 30.0 + seed,
                 "method": "michel", "pct_pruned": 50.0, "bleu": 20.0}
        curve = pd.DataFrame([("michel", 0, 0.0, 30.0 + seed), ("michel", 1, 50.0, 20.0 + seed),
                              ("random", 0, 0.0, 30.0 + seed), ("random", 1, 50.0, 10.0 + 3 * seed)],
                             columns=["order", "step", "pct_pruned", "bleu"])
        run = translated_run(tmp_path / "prune", str(seed), {"michel.0": start, "michel.1": michel, "random.0": start,
                                                             "random.1": rand}, references, metrics=prune)
        curve.to_csv(run / "curve.csv", index=False)
        bleus[seed] = curve
    voita = {"verb": "prune", "method": "voita", "checkpoint": CKPT, "types": ["enc-self"], "heads_pool": 12,
             "bleu_unpruned": 30.0}
    for job, (lam, bleu, pct) in enumerate([(0, 33.0, 0.0), (0.1, 31.0, 50.0)]):
        translated_run(tmp_path / "voita", str(job), {"unpruned": start, "pruned": michel if lam else start},
                       references, metrics={**voita, "l0_lambda": lam, "bleu": bleu, "pct_pruned": pct,
                                            "delta_bleu": bleu - 30.0, "kept_heads": 12 - int(pct * 12 / 100),
                                            **controlled("v", lam == 0)},
                       config={"seed": 1, "ckpt": CKPT, "prune": {"types": ["enc-self"], "l0_lambda": lam}})
    collection = collect([tmp_path])
    tests = tables.SavedHypotheses(200, 3)
    table = tables.comparison(collection, [50], tests=tests)
    cli_random = sacrebleu_paired(tmp_path / "cli1", references, start, rand, 200, 3)
    cli_pair = sacrebleu_paired(tmp_path / "cli2", references, michel, rand, 200, 3)
    randoms = table[table["method"] == "random"]
    assert randoms["p@50%"].tolist() == pytest.approx([cli_random["p_value"]] * 2, abs=1e-9)
    assert randoms["sig@50%"].tolist() == [cli_random["p_value"] < 0.05] * 2
    assert randoms["ΔBLEU@50%"].tolist() == pytest.approx([-18.0, -16.0])  # 10 + 3 seed - (30 + seed)
    # the Voita point is measured against its control (33), not the start (30)
    voita_row = table[table["method"] == "voita"].iloc[0]
    assert voita_row["reference"] == "λ=0 control" and voita_row["ΔBLEU@50%"] == pytest.approx(31.0 - 33.0)
    cli_voita = sacrebleu_paired(tmp_path / "cli3", references, start, michel, 200, 3)
    assert voita_row["p@50%"] == pytest.approx(cli_voita["p_value"], abs=1e-9)
    pairs = tables.pairwise(collection, [50], [], tests)
    assert len(pairs) == 2 and set(pairs["method"]) == {"michel"} and set(pairs["versus"]) == {"random"}
    assert pairs["p_value"].tolist() == pytest.approx([cli_pair["p_value"]] * 2, abs=1e-9)
    assert pairs["difference"].iloc[0] == pytest.approx(cli_pair["score"] - sacrebleu_paired(
        tmp_path / "cli4", references, michel, michel, 200, 3)["score"], abs=1e-9)
    lambdas = tables.controlled(collection, tests).set_index("l0_lambda")
    assert lambdas.loc[0.1, "bleu_control"] == 33.0 and lambdas.loc[0.1, "delta_bleu_control"] == pytest.approx(-2.0)
    assert lambdas.loc[0.1, "p_vs_control"] == pytest.approx(cli_voita["p_value"], abs=1e-9)
    # seeds: the two michel runs share a recipe; mean and sample standard deviation by hand
    table.insert(0, "model", "m")
    seeds = tables.over_seeds(table, ["types", "method"]).set_index("method")
    assert seeds.loc["random", "seeds"] == 2
    assert seeds.loc["random", "BLEU@50% mean"] == pytest.approx((13.0 + 16.0) / 2)
    assert seeds.loc["random", "BLEU@50% sd"] == pytest.approx(((13.0 - 14.5) ** 2 * 2) ** 0.5)
    assert seeds.loc["random", "sig@50%"] == f"{2 * (cli_random['p_value'] < 0.05)}/2"
    assert seeds.loc["voita", "seeds"] == 1 and pd.isna(seeds.loc["voita", "BLEU@50% sd"])  # one run: no spread
    marked = tables.markdown(tables.marked(table))
    assert ("-18.00*" in marked) == (cli_random["p_value"] < 0.05)


def chromium() -> str | None:
    import shutil
    return next((found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))),
                None)


@pytest.mark.slow
@pytest.mark.skipif(chromium() is None, reason="needs Chromium (Debian: apt-get install chromium)")
def test_report_html_renders_its_tables_and_images_in_a_browser(tmp_path):
    """report.html, opened offline in headless Chromium: every table is there with its rows, every embedded
    figure decodes to an image (naturalWidth > 0), and nothing is fetched from elsewhere."""
    import re
    import subprocess as sp
    study(tmp_path / "runs")
    out = tmp_path / "report"
    hprune("report", str(tmp_path / "runs"), f"hydra.run.dir={out}")
    page = (out / "report.html").read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page  # self-contained
    # a copy with a probe: after load, it writes each image's decoded width into the page
    probe = ("<script>window.onload=()=>{document.body.setAttribute('data-images',"
             "[...document.images].map(i=>i.complete?i.naturalWidth:-1).join(','))}</script></body>")
    (tmp_path / "probe.html").write_text(page.replace("</body>", probe))
    dom = sp.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                  "--dump-dom", (tmp_path / "probe.html").as_uri()], capture_output=True, text=True, timeout=120,
                 check=True).stdout
    widths = [int(w) for w in re.search(r'data-images="([^"]*)"', dom).group(1).split(",")]
    assert len(widths) == page.count("<img") >= 3 and min(widths) > 100, widths
    assert dom.count("<table>") == page.count("<table>") >= 4
    assert "<td>michel</td>" in dom and "Incomplete runs" in dom
