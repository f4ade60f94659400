"""The figures README.md and docs/ quote, regenerated from runs, and checked against them.

A page holds each generated section between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->`; BLOCKS says
which runs make it and how far a fresh run may land from the page (its spread, stated in the section):

    make demo && bash scripts/study_methods.sh      # the runs (outputs/demo, outputs/study)
    python scripts/doc_figures.py                   # rewrite every section from them
    python scripts/doc_figures.py --check           # exit 1 where a page and the runs disagree beyond the spread

`make docs-check` runs the demo and the check: a page whose figures a fresh run does not reproduce fails it. The
same runs write scripts/demo_expected.json, the ranges `make demo`'s summary holds its figures against (their
spread over the study's seeds); the check fails where the file and the runs disagree.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"[-−+]?\d+(?:\.\d+)?")


def _markdown(table: pd.DataFrame) -> str:
    from hprune.reporting.tables import markdown

    return markdown(table)


def _fmt(value, digits: int = 2) -> str:
    return "" if pd.isna(value) else f"{value:.{digits}f}"


def _span(values: pd.Series) -> str:
    low, high = int(values.min()), int(values.max())
    return f"{low}" if low == high else f"{low}–{high}"


def _sd(mean, sd, digits: int = 1) -> str:
    return "" if pd.isna(mean) else f"{mean:.{digits}f}" + ("" if pd.isna(sd) else f" ± {sd:.{digits}f}")


# --------------------------------------------------------------------------------------------- the demo
def demo_comparison(runs: Path) -> str:
    table = pd.read_csv(runs / "demo" / "report" / "comparison.csv")
    table = table.dropna(subset=[f"BLEU@{s}%" for s in (25, 50, 75)], how="all")  # a point at none of them
    rows = []
    for _, r in table.iterrows():
        pool = "" if r["types"] == "enc-self,dec-self,dec-enc" else f" ({r['types']} only)"
        row = {"method": r["method"] + pool, "reference": r["reference"], "reference BLEU": _fmt(r["reference_bleu"])}
        for s in (25, 50, 75):
            star = "*" if str(r.get(f"sig@{s}%")) == "True" else ""
            row[f"BLEU@{s}%"] = _fmt(r[f"BLEU@{s}%"])
            row[f"ΔBLEU@{s}%"] = "" if pd.isna(r[f"ΔBLEU@{s}%"]) else f"{r[f'ΔBLEU@{s}%']:+.2f}{star}"
        rows.append(row)
    return _markdown(pd.DataFrame(rows))


def demo_findings(runs: Path) -> str:
    demo = runs / "demo"
    fisher = json.loads((demo / "fisher" / "metrics.json").read_text())
    stages = pd.read_csv(demo / "fisher" / "stages.csv").set_index("stage")["bleu"]
    macs = pd.read_csv(demo / "report" / "matched_macs.csv").iloc[0]
    others = [m for m in ("michel", "random", "confidence", "lrp") if m in macs and not pd.isna(macs[m])]
    pairs = pd.read_csv(demo / "report" / "pairwise.csv")
    mr = pairs[(pairs["method"] == "michel") & (pairs["versus"] == "random")].set_index("sparsity")
    types = pd.read_csv(demo / "prune" / "ablation_types.csv").set_index("type")
    lines = [
        f"- Kwon et al.'s search (`outputs/demo/fisher`) kept {fisher['kept_heads']} heads, "
        f"{fisher['attention_macs_pct']:.1f} % of the attention MACs, BLEU {fisher['bleu']:.2f} (stages: "
        + ", ".join(f"{stage} {bleu:.2f}" for stage, bleu in stages.items()) + "); at the same MACs "
        + ", ".join(f"{m} {macs[m]:.2f}" for m in others) + " (`matched_macs.md`).",
        "- Michel's order against random (`pairwise.md`): "
        + "; ".join(f"{s:g} %: {r['bleu']:.2f} vs {r['bleu_versus']:.2f} (p = {r['p_value']:.3f})"
                    for s, r in mr.iterrows()) + ".",
        "- Every head of one type removed (`ablation_types.csv`): "
        + ", ".join(f"{t} {-types.loc[t, 'delta_bleu']:.1f} BLEU lost" for t in types.index) + ".",
    ]
    return "\n".join(lines) + "\n"


def demo_controlled(runs: Path) -> str:
    table = pd.read_csv(runs / "demo" / "report" / "controlled.csv")
    rows = [{"run": r["run"], "λ": f"{r['l0_lambda']:g}" + (" (control)" if r["l0_lambda"] == 0 else ""),
             "heads kept": int(r["kept_heads"]), "BLEU": _fmt(r["bleu"]), "ΔBLEU vs start": _fmt(r["delta_bleu"]),
             "ΔBLEU vs control": _fmt(r.get("delta_bleu_control")), "p vs control": _fmt(r.get("p_vs_control"), 3)}
            for _, r in table.sort_values("l0_lambda").iterrows()]
    return _markdown(pd.DataFrame(rows))


# ------------------------------------------------------------------------------------ real language
def _real_seed_runs(runs: Path) -> list[tuple[str, Path, Path]]:
    """(seed, model run, study folder) of every trained seed of scripts/study_real.sh."""
    study = runs / "real" / "study"
    seeds = sorted(p.name for p in study.iterdir() if p.name.isdigit() and (p / "eval" / "metrics.json").is_file())
    if not seeds:
        raise FileNotFoundError(2, "no evaluated seed", str(study / "<seed>" / "eval" / "metrics.json"))
    return [(seed, runs / "real" / "seeds" / seed, study / seed) for seed in seeds]


def _metrics(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def real_summary(runs: Path) -> str:
    from hprune.analysis.roles import ENCODER_ROLES
    from hprune.analysis.survival import role_survival_test, sweep_masks

    rows = []
    for seed, model, study in _real_seed_runs(runs):
        trained, evaluated = _metrics(model / "metrics.json"), _metrics(study / "eval" / "metrics.json")
        analyzed = _metrics(study / "analyze" / "metrics.json")
        fisher = _metrics(study / "fisher" / "metrics.json")
        row = {"training seed": seed,
               "BLEU / chrF (held-out chapters)": f"{evaluated['bleu']:.2f} / {evaluated['chrf']:.2f}",
               "updates (epochs)": f"{trained['num_updates']:,} ({trained['epoch']})",
               "fisher, half the attention MACs": "" if not fisher else
               f"{fisher['kept_heads']} heads, BLEU {fisher['bleu']:.2f}"}
        if analyzed:
            roles = pd.read_csv(study / "analyze" / "head_roles.csv")
            enc = roles[roles["type"] == "enc-self"]
            test = role_survival_test(enc, sweep_masks(study / "voita"), list(ENCODER_ROLES)) \
                if (study / "voita").is_dir() else None
            row.update({
                "positional / rare-token heads (of 12 enc-self)": f"{analyzed['positional_heads']} / "
                                                                   f"{analyzed['rare_heads']}",
                "best alignment head: AER (manual)": f"{analyzed['best_alignment_aer']:.3f} "
                                                     f"({analyzed['best_alignment_head']})",
                "eflomal AER (same verses)": _fmt(analyzed.get("eflomal_aer"), 3),
                "survival p (roles, Voita λ = 1)": _survival_cell(test)})
        rows.append(row)
    return _markdown(pd.DataFrame(rows))


def _survival_cell(test: dict | None) -> str:
    """The survival test's p, or why there is none (the gates not trained yet; no heads on one side)."""
    if not test:
        return ""
    if test["p_value"] is None:
        return f"untestable ({test['role_heads']} role heads, {test['other_heads']} others)"
    return f"{test['p_value']:.3f}"


def real_methods(runs: Path) -> str:
    report = runs / "real" / "study" / "report"
    comparison = pd.read_csv(report / "comparison.csv")
    pairs = pd.read_csv(report / "pairwise.csv") if (report / "pairwise.csv").is_file() else pd.DataFrame()
    rows = []
    for method in ("michel", "random", "confidence", "lrp"):
        runs_ = comparison[comparison["method"] == method]
        if runs_.empty:
            continue
        row = {"method": f"`{method}`", "seeds": len(runs_)}
        for s in (25, 50, 75):
            values = runs_[f"BLEU@{s}%"].astype(float)
            row[f"BLEU at {s} %"] = _sd(values.mean(), values.std(), 2)
            if method != "michel" and not pairs.empty:
                won = pairs[(pairs["method"] == "michel") & (pairs["versus"] == method) & (pairs["sparsity"] == s)]
                significant = won["significant"].astype(bool)
                better = int((significant & (won["bleu"] > won["bleu_versus"])).sum())
                worse = int((significant & (won["bleu"] < won["bleu_versus"])).sum())
                row[f"BLEU at {s} %"] += f" (p < 0.05: Michel better in {better}, worse in {worse} of {len(won)})"
        rows.append(row)
    controlled = pd.read_csv(report / "controlled.csv") if (report / "controlled.csv").is_file() else None
    for method, knob in (("voita", "l0_lambda"), ("dsp", "head_budget")):
        if controlled is None:  # the trained methods have not run yet
            break
        pruned = controlled[(controlled["method"] == method) & controlled["control_run"].notna()]
        if pruned.empty:
            continue
        delta = pruned["delta_bleu_control"].astype(float)
        significant = int(pruned.get("significant_vs_control", pd.Series(dtype=bool)).fillna(False).astype(bool).sum())
        rows.append({"method": f"`{method}` ({knob} {pruned[knob].iloc[0]:g})", "seeds": len(pruned),
                     "trained, against its control": f"{_span(pruned['kept_heads'])} heads kept: BLEU "
                     f"{_sd(pruned['bleu'].mean(), pruned['bleu'].std(), 2)}, ΔBLEU vs its control "
                     f"{_sd(delta.mean(), delta.std(), 2)} (p < 0.05 in {significant})"})
    return _markdown(pd.DataFrame(rows).fillna(""))


def real_recovery(runs: Path) -> str:
    """scripts/study_recovery.sh's runs: per latency budget, the pruned model and what each loss won back."""
    from hprune.recovery import versus

    study = runs / "real" / "recovery"
    pruned = sorted(study.glob("*/fisher_*/metrics.json"), key=lambda f: (f.parts[-3], -float(f.parts[-2][7:])))
    if not pruned:
        raise FileNotFoundError(2, "no pruned model", str(study / "<seed>" / "fisher_<budget>" / "metrics.json"))
    rows, recoveries = [], []
    for metrics_file in pruned:
        m, run = json.loads(metrics_file.read_text()), metrics_file.parent
        measured = f"{m['latency_pct_measured']:.1f} %"
        if "latency_pct_low" in m:
            measured += f" ({m['latency_pct_low']:.1f}–{m['latency_pct_high']:.1f})"
        row = {"seed": run.parent.name, "latency budget": f"{m['latency_budget']:g}"
               + ("" if m.get("latency_met", True) else " (not met)"),
               "kept: heads, FFN neurons": f"{m['kept_heads']} of {m['heads_pool']}, {m['kept_neurons']:,} of "
                                           f"{m['neurons_pool']:,}",
               "CTranslate2 latency (rounds)": measured, "BLEU pruned (vs unpruned)": f"{m['bleu']:.2f} ({m['delta_bleu']:+.2f})"}
        for loss in ("ce", "word", "sequence"):
            r = _metrics(run / loss / "metrics.json")
            if r:
                recoveries.append(r)
            row[f"recovered: {loss}"] = "" if not r else (
                f"{r['bleu_recovered']:.2f} ({versus(r, 'pruned')}; {r['delta_bleu_recovered']:+.2f} vs unpruned, "
                f"{versus(r, 'unpruned')})")
        rows.append(row)
    first = json.loads(pruned[0].read_text())
    trained = _metrics(runs / "real" / "seeds" / pruned[0].parts[-3] / "metrics.json")
    seconds = [r["recovery_seconds"] for r in recoveries]
    about = (f"The unpruned model: BLEU {first['bleu_unpruned']:.2f}"
             + (f" ({trained['num_updates']:,} updates, {trained['epoch']} epochs)" if trained else "") + ". "
             + (f"Each recovery: {_span(pd.Series([r['recovery_updates'] for r in recoveries]))} updates, "
                f"{min(seconds):.0f}–{max(seconds):.0f} s of training on this machine's CPU; " if recoveries else "")
             + "p: paired bootstrap against the pruned model, then against the unpruned one.\n\n")
    return about + _markdown(pd.DataFrame(rows))


# --------------------------------------------------------------------------------------------- the study
DECIDES = {"michel": "gradient importance (Michel et al.)", "lrp": "LRP relevance (Voita et al. §4)",
           "magnitude": "L1 of q/k/v rows (fairseq)", "confidence": "mean max attention (Voita et al.)",
           "random": "a seeded shuffle"}


def study_table(runs: Path) -> str:
    report = runs / "study" / "report"
    seeds = pd.read_csv(report / "comparison_seeds.csv")
    rows = []
    for _, r in seeds[seeds["method"].isin(list(DECIDES))].iterrows():
        rows.append({"method": f"`{r['method']}`", "what decides the heads": DECIDES[r["method"]],
                     "BLEU at 25 % / 50 % / 75 % pruned": " / ".join(
                         _sd(r[f"BLEU@{s}% mean"], r[f"BLEU@{s}% sd"]) for s in (25, 50, 75))})
    controlled = pd.read_csv(report / "controlled.csv")
    for method, label, budget, how in (("dsp", "`dsp`, K = 18, 400 updates", 18,
                                        "a learned Gumbel soft top-K, trained with the model (Li et al.)"),
                                       ("voita", "`voita`, head budget 18, 800 updates", 18,
                                        "Hard Concrete gates + L0, decoder not frozen (Voita et al.)")):
        runs_ = controlled[(controlled["method"] == method) & (controlled["head_budget"] == budget)]
        if runs_.empty:
            continue
        delta = runs_["delta_bleu_control"].astype(float)
        significant = int(runs_.get("significant_vs_control", pd.Series(dtype=bool)).fillna(False).astype(bool).sum())
        rows.append({"method": label, "what decides the heads": how, "BLEU at 25 % / 50 % / 75 % pruned":
                     f"{_span(runs_['kept_heads'])} heads kept: "
                     f"{_sd(runs_['bleu'].mean(), runs_['bleu'].std())}; its control "
                     f"{runs_['bleu_control'].astype(float).mean():.1f}: ΔBLEU {_sd(delta.mean(), delta.std())}, "
                     f"significant in {significant} of {len(runs_)} seed(s)"})
    fisher = _fisher_runs(runs)
    rows.append({"method": "`fisher`, MACs budget 0.5", "what decides the heads":
                 "Fisher search, rearrangement, mask tuning, no retraining (Kwon et al.)",
                 "BLEU at 25 % / 50 % / 75 % pruned":
                 f"{_span(fisher['kept_heads'])} heads "
                 f"({fisher['macs'].min():.0f}–{fisher['macs'].max():.0f} % of the attention MACs): "
                 f"{_sd(fisher['bleu'].mean(), fisher['bleu'].std())} over {len(fisher)} runs "
                 f"({fisher['seed'].nunique()} seeds × 3 calibration draws)"})
    return _markdown(pd.DataFrame(rows))


def study_summary(runs: Path) -> str:
    report = runs / "study" / "report"
    comparison = pd.read_csv(report / "comparison.csv")
    unpruned = comparison[comparison["method"] == "michel"].sort_values("train_seed")["reference_bleu"]
    pairs = pd.read_csv(report / "pairwise_seeds.csv")
    michel = pairs[(pairs["method"] == "michel") & (pairs["versus"] == "random")].set_index("sparsity")
    controlled = pd.read_csv(report / "controlled.csv")
    controls = controlled[(controlled["method"] == "voita") & (controlled["l0_lambda"] == 0)]["delta_bleu"]
    seeds = sorted(comparison["train_seed"].dropna().astype(int).unique())
    rows = [("BLEU of the converged model (1,000 updates), by training seed", ", ".join(f"{b:.2f}" for b in unpruned)),
            ("Michel's order beats random, paired bootstrap p < 0.05, in how many seeds",
             "; ".join(f"at {s:g} %: {r['significant']}" for s, r in michel.iterrows())),
            (f"BLEU change of 800 more updates without pruning (Voita's λ = 0 control), {len(controls)} seed(s)",
             ", ".join(f"{d:+.2f}" for d in controls))]
    header = f"training seeds {', '.join(map(str, seeds))}"
    return _markdown(pd.DataFrame(rows, columns=["measured on the demo recipe (36 heads pooled)", header]))


def _fisher_runs(runs: Path) -> pd.DataFrame:
    rows = []
    for metrics_file in sorted((runs / "study").glob("*/fisher/*/metrics.json")):
        m = json.loads(metrics_file.read_text())
        stages = pd.read_csv(metrics_file.parent / "stages.csv").set_index("stage")
        rows.append({"seed": metrics_file.parts[-4], "draw": metrics_file.parts[-2], "kept_heads": m["kept_heads"],
                     "macs": m["attention_macs_pct"], "bleu": m["bleu"],
                     "sig_rearranged": str(stages["significant_vs_previous"].get("rearranged")) == "True",
                     "sig_tuned": str(stages["significant_vs_previous"].get("tuned")) == "True",
                     "rearranged": stages.loc["rearranged", "bleu"] - stages.loc["search", "bleu"]
                     if "rearranged" in stages.index else float("nan"),
                     "tuned": stages.loc["tuned", "bleu"] - stages.loc[stages.index[-2], "bleu"]
                     if "tuned" in stages.index else float("nan")})
    return pd.DataFrame(rows)


def study_fisher(runs: Path) -> str:
    fisher = _fisher_runs(runs)
    macs = pd.read_csv(runs / "study" / "report" / "matched_macs.csv")
    pairs = []
    for _, row in macs.iterrows():
        seed, draw = Path(row["run"]).parts[-3], Path(row["run"]).parts[-1]
        pairs.append(f"seed {seed} draw {draw}: {row['fisher']:.2f} (michel {row['michel']:.2f}, lrp {row['lrp']:.2f})")
    beats = {m: int((macs["fisher"] > macs[m]).sum()) for m in ("michel", "lrp")}
    return ("- BLEU at the MACs each fisher run reached, against Michel's and LRP's curves interpolated there "
            f"(`matched_macs.md`): {'; '.join(pairs)}. Fisher is ahead of Michel's order in {beats['michel']} of "
            f"{len(macs)} runs and of LRP's in {beats['lrp']}.\n"
            f"- `stages.csv` (each stage against the one before, paired bootstrap): rearrangement left BLEU unchanged "
            f"in {int((fisher['rearranged'] == 0).sum())} of {len(fisher)} runs and changed it by "
            f"{fisher['rearranged'].min():+.2f} to {fisher['rearranged'].max():+.2f}, significantly in "
            f"{int(fisher['sig_rearranged'].sum())}; tuning changed it by {fisher['tuned'].min():+.2f} to "
            f"{fisher['tuned'].max():+.2f}, significantly in {int(fisher['sig_tuned'].sum())} of {len(fisher)}.\n")


# ------------------------------------------------------------------------------- the demo's expected ranges
EXPECTED = ROOT / "scripts" / "demo_expected.json"
ABOUT = ("what `make demo` should print (scripts/demo_summary.py compares): each headline figure's mean +- 3 sd over "
         "training seeds, from the demo's own settings on each seed's model (scripts/study_methods.sh: "
         "outputs/study_demo), rounded outward to 0.1; Michel against random: 1..1 where it won in every seed; the "
         "retraining-free search's seconds: a bound. Written by scripts/doc_figures.py")


def _outward(low: float, high: float) -> list:
    return [math.floor(low * 10 + 1e-9) / 10, math.ceil(high * 10 - 1e-9) / 10]


def demo_expected(runs: Path) -> dict:
    """scripts/demo_expected.json from the runs: the spread over seeds of what `make demo` prints."""
    demo = runs / "study_demo"
    seeds = sorted(int(p.name) for p in demo.iterdir() if p.name.isdigit()) if demo.is_dir() else []
    if len(seeds) < 2:
        raise FileNotFoundError(2, "no runs of two seeds or more", str(demo / "<seed>"))
    values: dict = {"unpruned_bleu": [], "control_change": [], "enc_self_removed_drop": []}
    for seed in seeds:
        control, removed = (json.loads((demo / str(seed) / run / "metrics.json").read_text())
                            for run in ("control", "no_enc_self"))
        values["unpruned_bleu"].append(control["bleu_unpruned"])
        values["control_change"].append(control["delta_bleu"])
        values["enc_self_removed_drop"].append(control["bleu_unpruned"] - removed["bleu"])
    ranges = {}
    for key, figures in values.items():
        figures = pd.Series(figures, dtype=float)
        ranges[key] = _outward(figures.mean() - 3 * figures.std(), figures.mean() + 3 * figures.std())
    ranges["unpruned_bleu"][1] = min(ranges["unpruned_bleu"][1], 100.0)
    pairs = pd.read_csv(runs / "study" / "report" / "pairwise_seeds.csv")
    michel = pairs[(pairs["method"] == "michel") & (pairs["versus"] == "random")].set_index("sparsity")
    for sparsity in (25, 50):
        won, of = map(int, str(michel.loc[sparsity, "significant"]).split("/"))
        ranges[f"michel_beats_random_{sparsity}"] = [1, 1] if won == of else [0, 1]
    ranges["fisher_seconds"] = [0, 60]
    return {"about": ABOUT, "seeds": seeds, "values": {key: [round(v, 2) for v in figures]
                                                        for key, figures in values.items()}, "ranges": ranges}


def expected_problems(runs: Path, check: bool) -> list:
    """Write scripts/demo_expected.json from the runs, or (check) say where it and the runs disagree."""
    try:
        fresh = demo_expected(runs)
    except FileNotFoundError as err:
        return [f"{EXPECTED.relative_to(ROOT)}: no runs to make it from ({err.filename}); run "
                "scripts/study_methods.sh"]
    if not check:
        text = json.dumps(fresh, indent=1, ensure_ascii=False)
        text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + ", ".join(x.strip() for x in m[1].split(",")) + "]", text)
        EXPECTED.write_text(text + "\n")  # (a list of numbers on one line)
        return []
    on_file = json.loads(EXPECTED.read_text()).get("ranges", {})
    far = [key for key, bounds in fresh["ranges"].items()
           if key not in on_file or any(abs(a - b) > 0.05 for a, b in zip(on_file[key], bounds))]
    return [f"{EXPECTED.relative_to(ROOT)}: " + ", ".join(f"{key} {on_file.get(key)} vs the runs' "
                                                          f"{fresh['ranges'][key]}" for key in far)] if far else []


@dataclass(frozen=True)
class Block:
    make: Callable[[Path], str]
    spread: float  # how far (in the page's units, BLEU) a fresh run may land from a figure on the page
    runs: tuple  # the folders of --runs it is made from (their metrics.json say which commit ran them)
    optional: bool = False  # runs that `make docs-check` does not make (the real-language study): absent, no problem


DEMO, STUDY, REAL = ("demo",), ("demo", "seeds", "study", "study_demo"), ("real",)
BLOCKS = {
    "demo-comparison": Block(demo_comparison, 30.0, DEMO),
    "demo-findings": Block(demo_findings, 30.0, DEMO),
    "demo-controlled": Block(demo_controlled, 5.0, DEMO),
    "study-summary": Block(study_summary, 0.05, STUDY),
    "study-table": Block(study_table, 0.05, STUDY),
    "study-fisher": Block(study_fisher, 0.05, STUDY),
    "real-summary": Block(real_summary, 0.05, REAL, optional=True),
    "real-methods": Block(real_methods, 0.05, REAL, optional=True),
    "real-recovery": Block(real_recovery, 0.05, ("real/recovery",), optional=True),
}


# ------------------------------------------------------------------------------------------- provenance
# Every section ends with the commits its runs were made with, so that a section older than the code is seen:
# the check fails where the page's commits are not the runs', and says which commits since changed the code.
PROVENANCE = re.compile(r"^<sub>Figures from runs of commit[^\n]*</sub>\n?", re.M)
CODE = ("src", "cli", "configs", "scripts/study_methods.sh", "scripts/study_real.sh", "scripts/study_recovery.sh",
        "scripts/reproduce_common.sh")


def run_commits(runs: Path, folders: tuple) -> tuple[list[str], str]:
    """The commits (short) the runs under `folders` were made with (metrics.json's git_sha, the most runs first),
    and the date of the newest run."""
    counts: dict = {}
    newest = 0.0
    for folder in folders:
        for metrics in (runs / folder).rglob("metrics.json"):
            sha = json.loads(metrics.read_text()).get("git_sha", "unknown")
            counts[sha[:10]] = counts.get(sha[:10], 0) + 1
            newest = max(newest, metrics.stat().st_mtime)
    date = pd.Timestamp(newest, unit="s").strftime("%Y-%m-%d") if newest else "no metrics.json"
    return sorted(counts, key=lambda sha: -counts[sha]) or ["unknown"], date


def provenance_line(runs: Path, block: Block) -> str:
    commits, date = run_commits(runs, block.runs)
    folders = ", ".join(f"outputs/{f}" for f in block.runs if (runs / f).exists())
    return (f"<sub>Figures from runs of commit {', '.join(commits)} ({folders}, {date}), written by "
            "`python scripts/doc_figures.py`.</sub>\n")


def page_commits(body: str) -> list[str]:
    line = PROVENANCE.search(body)
    return re.findall(r"\b[0-9a-f]{7,40}\b|unknown", line.group(0).split("(")[0]) if line else []


def changed_since(commit: str) -> int:
    """How many commits after `commit` touched the code the runs ran (-1: not a commit of this repository)."""
    out = subprocess.run(["git", "rev-list", "--count", f"{commit}..HEAD", "--", *CODE], cwd=ROOT,
                         capture_output=True, text=True)
    return int(out.stdout) if out.returncode == 0 and out.stdout.strip().isdigit() else -1
PAGES = ("README.md", "docs/outputs.md", "docs/methods.md")
IMAGES = {"docs/demo_bleu_vs_pruned.png": "demo/report/plots/bleu_vs_pruned_demo_enc_self_dec_self_dec_enc.png",
          "docs/demo_lambda.png": "demo/report/plots/voita_l0_lambda_enc_self.png",
          "docs/real_recovery_frontier.png": "real/recovery/1/report/plots/frontier_1.png"}  # copied by a write, not checked
SECTION = re.compile(r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.S)


def numbers(text: str) -> list[float]:
    return [float(n.replace("−", "-")) for n in NUMBER.findall(text)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare the pages with the runs; write nothing")
    parser.add_argument("--runs", type=Path, default=ROOT / "outputs", help="the folder holding demo/ and study/")
    parser.add_argument("--pages", nargs="+", default=list(PAGES), help="the pages (default: %(default)s)")
    args = parser.parse_args()
    problems, written = [], 0
    for page in args.pages:
        path = ROOT / page
        text = path.read_text()

        def section(match: re.Match) -> str:
            nonlocal written
            name = match["name"]
            if name not in BLOCKS:
                problems.append(f"{page}: unknown section {name}")
                return match.group(0)
            try:
                fresh = BLOCKS[name].make(args.runs)
            except FileNotFoundError as err:
                if BLOCKS[name].optional:
                    print(f"{page}: {name}: left as it is, no runs to make it from ({err.filename})", file=sys.stderr)
                else:
                    problems.append(f"{page}: {name}: no runs to make it from ({err.filename}); run them first")
                return match.group(0)
            block = BLOCKS[name]
            commits, _ = run_commits(args.runs, block.runs)
            if args.check:
                body = PROVENANCE.sub("", match["body"])
                old, new = numbers(body), numbers(fresh)
                far = [(a, b) for a, b in zip(old, new) if abs(a - b) > block.spread]
                if len(old) != len(new) or far:
                    problems.append(f"{page}: {name}: " + (f"{len(old)} figures on the page, {len(new)} from the "
                                    "runs" if len(old) != len(new) else
                                    f"{len(far)} figures beyond ±{block.spread:g} (page vs run: "
                                    + ", ".join(f"{a:g} vs {b:g}" for a, b in far[:5]) + ")"))
                on_page = page_commits(match["body"])
                if on_page != commits:
                    problems.append(f"{page}: {name}: the page's figures are from runs of commit "
                                    f"{', '.join(on_page) or '(none said)'}, the runs are of {', '.join(commits)}: "
                                    "rewrite them (python scripts/doc_figures.py)")
            else:
                written += 1
            for commit in (c for c in commits if c != "unknown"):
                since = changed_since(commit)
                if since:
                    print(f"{page}: {name}: " + (f"{since} commit(s) since {commit} changed the code these runs ran "
                                                 f"(git log {commit}..HEAD -- {' '.join(CODE)}): run them again"
                                                 if since > 0 else f"{commit} is no commit of this repository"),
                          file=sys.stderr)
            if args.check:
                return match.group(0)
            return match.group(1) + fresh.rstrip("\n") + "\n\n" + provenance_line(args.runs, block) + match.group(4)

        updated = SECTION.sub(section, text)
        if not args.check and updated != text:
            path.write_text(updated)
    if args.pages == list(PAGES):
        problems += expected_problems(args.runs, args.check)
    if not args.check and args.pages == list(PAGES):
        for image, source in IMAGES.items():
            if (args.runs / source).is_file():
                shutil.copyfile(args.runs / source, ROOT / image)
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{'checked' if args.check else 'wrote'} the figure sections of {', '.join(args.pages)}: "
          f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
