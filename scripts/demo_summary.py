"""The end of `make demo`: what the study found, from the files it wrote, next to the range the README expects.

    python scripts/demo_summary.py outputs/demo

Reads the report (comparison with significance, pairwise tests, trained methods against their controls,
matched MACs), the whole-type ablation of the Michel run, the retraining-free run's stages, the head roles of the
start model (and LRP against confidence) and each Voita run's mask. Expected ranges (demo_expected.json beside
this script) are the spread measured over seeds; a value outside its range is flagged, not an error.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from hprune.analysis.roles import ENCODER_ROLES
from hprune.analysis.survival import has_role, role_survival_test, sweep_masks
from hprune.recovery import versus


def role_survival(roles: pd.DataFrame, masks: dict) -> list[dict]:
    """Per λ: the share of role heads among the surviving encoder self-attention heads, and among all of them."""
    enc = roles[roles["type"] == "enc-self"].copy()
    enc["role"] = has_role(enc, list(ENCODER_ROLES))
    rows = []
    for lam, mask in masks.items():
        alive = enc[[bool(mask["enc-self"][layer][head]) for layer, head in zip(enc["layer"], enc["head"])]]
        rows.append({"λ": lam, "kept": len(alive), "role heads kept": int(alive["role"].sum()),
                     "share among kept": alive["role"].mean() if len(alive) else float("nan")})
    return sorted(rows, key=lambda r: r["λ"]), enc["role"].mean()


def survival_test(found: dict, key: str, roles: pd.DataFrame, masks: dict, columns: list, role: str) -> None:
    """Voita et al.'s finding on one sweep: do the gated heads with a role stay open at more of its λ?"""
    test = role_survival_test(roles, masks, columns)
    if test["p_value"] is None:
        print(f"  do heads with {role} survive longer? not testable: {test['role_heads']} of "
              f"{test['role_heads'] + test['other_heads']} gated heads have one")
        return
    found[key] = test["p_value"]
    print(f"  do heads with {role} survive longer (Voita et al.)? open at {test['mean_open_role']:.2f} of the "
          f"{len(test['lambdas'])} λ > 0 on average, against {test['mean_open_other']:.2f} for the "
          f"{test['other_heads']} heads without: p = {test['p_value']:.4f} (permutation test of the roles)")


def main(demo: Path) -> None:
    expected = json.loads((Path(__file__).with_name("demo_expected.json")).read_text())
    found: dict = {}
    found["unpruned_bleu"] = json.loads((demo / "eval" / "metrics.json").read_text())["bleu"]
    types = pd.read_csv(demo / "prune" / "ablation_types.csv").set_index("type")
    found["enc_self_removed_drop"] = -float(types.loc["enc-self", "delta_bleu"])
    found["most_sensitive_type"] = str(types["bleu"].idxmin())
    trained = pd.read_csv(demo / "report" / "controlled.csv")
    control = trained[trained["l0_lambda"] == 0]
    found["control_change"] = float(control["delta_bleu"].iloc[0]) if len(control) else float("nan")
    pairs = pd.read_csv(demo / "report" / "pairwise.csv")
    michel_vs_random = pairs[(pairs["method"] == "michel") & (pairs["versus"] == "random")].set_index("sparsity")
    roles = pd.read_csv(demo / "analyze" / "head_roles.csv")
    analyzed = json.loads((demo / "analyze" / "metrics.json").read_text())
    for role in ENCODER_ROLES:
        found[f"{role}_heads"] = analyzed[f"{role}_heads"]
    masks = sweep_masks(demo / "voita")
    survival, share_all = role_survival(roles, masks)

    print("\n== hprune demo: summary")
    print((demo / "report" / "comparison.md").read_text(), end="")
    print("* : p < 0.05 against the reference: the unpruned model; for Voita's gates the λ = 0 control (paired "
          "bootstrap, sacreBLEU)")
    for sparsity, row in michel_vs_random.iterrows():
        verdict = "beats" if row["difference"] < 0 and row["significant"] else "does not beat"
        print(f"at {sparsity:g} % pruned, Michel's order {verdict} random: BLEU {row['bleu']:.2f} vs "
              f"{row['bleu_versus']:.2f} (p = {row['p_value']:.4f})")
        found[f"michel_beats_random_{sparsity:g}"] = bool(verdict == "beats")
    print(f"removing all encoder self-attention costs {found['enc_self_removed_drop']:.2f} BLEU; most sensitive "
          f"type: {found['most_sensitive_type']} (every head of one type removed, ablation_types.csv)")
    fisher = json.loads((demo / "fisher" / "metrics.json").read_text())
    stages = pd.read_csv(demo / "fisher" / "stages.csv")
    found["fisher_seconds"] = fisher["seconds"]
    print(f"Kwon et al. (fisher), half the attention MACs: {fisher['kept_heads']} of {fisher['heads_pool']} heads, "
          f"{fisher['attention_macs_pct']:g} % of the MACs in the cost model, "
          f"{100 * fisher['attention_macs_per_token_pruned'] / fisher['attention_macs_per_token_unpruned']:.1f} % "
          f"counted on the pruned export; {fisher['seconds']:.1f} s, no retraining; BLEU by stage: "
          + ", ".join(f"{r.stage} {r.bleu:.2f}" for r in stages.itertuples()))
    matched = demo / "report" / "matched_macs.csv"
    if matched.exists():
        row = pd.read_csv(matched).iloc[0]
        others = [c for c in row.index if c not in ("model", "types", "run", "macs_budget", "attention MACs kept %",
                                                     "fisher") and pd.notna(row[c])]
        print(f"  at the same {row['attention MACs kept %']:g} % of the attention MACs: fisher {row['fisher']:.2f}, "
              + ", ".join(f"{c} {row[c]:.2f}" for c in others) + " (curves interpolated)")
    ffn_run = demo / "fisher_ffn" / "metrics.json"
    if ffn_run.exists():  # Kwon et al.'s whole framework, and what both runs buy in CTranslate2
        ffn = json.loads(ffn_run.read_text())
        print(f"  heads + FFN neurons at half the MACs of both: {ffn['kept_heads']} heads and {ffn['kept_neurons']} of "
              f"{ffn['neurons_pool']} neurons kept, BLEU {ffn['bleu']:.2f}, "
              f"{100 * ffn['macs_per_token_pruned'] / ffn['macs_per_token_unpruned']:.1f} % of the model's MACs counted; "
              f"latency in CTranslate2 {ffn['latency_pct_measured']:g} % of the unpruned model's (heads only, above: "
              f"{fisher.get('latency_pct_measured', float('nan')):g} %)")
    recovered_run = demo / "fisher_ffn_recovered" / "metrics.json"
    if recovered_run.exists():  # hprune recover: what training on from the unpruned model wins back
        rec = json.loads(recovered_run.read_text())
        print(f"  recovered ({rec['recovery_loss']}-level distillation from the unpruned model, {rec['recovery_updates']} "
              f"updates, {rec['recovery_seconds']:.0f} s): BLEU {rec['bleu_before_recovery']:.2f} -> "
              f"{rec['bleu_recovered']:.2f} ({versus(rec, 'pruned')}), {rec['delta_bleu_recovered']:+.2f} "
              f"against the unpruned model ({versus(rec, 'unpruned')})")
    if (demo / "report" / "frontier.csv").exists():
        print(f"  BLEU against latency, every run that measured it: {demo / 'report' / 'plots' / 'frontier_demo.png'}")
    print(f"the λ = 0 control changed BLEU by {found['control_change']:+.2f} (continued training alone)")
    print(f"head roles on the start model: {analyzed['positional_heads']} positional, {analyzed['syntactic_heads']} "
          f"syntactic, {analyzed['rare_heads']} rare-token of 12 encoder self-attention heads "
          f"({share_all:.0%} have a role)")
    if analyzed.get("alignment_heads") is not None:
        print(f"  decoder self-attention: {analyzed['dec_self_positional_heads']} positional of 12; encoder-decoder: "
              f"{analyzed['alignment_heads']} alignment heads of 12 (AER <= {analyzed['alignment_max_aer']:g} against the "
              f"generator's gold alignments), the best {analyzed['best_alignment_head']} with AER "
              f"{analyzed['best_alignment_aer']:.3f}; the best layer's mean map {analyzed['best_layer_aer']:.3f}")
    if "lrp_confidence_spearman_all" in analyzed:
        found["lrp_confidence_spearman"] = analyzed["lrp_confidence_spearman_all"]
        print(f"LRP relevance vs confidence (Voita et al. §4), Spearman's rank correlation over all 36 heads: "
              f"{analyzed['lrp_confidence_spearman_all']:+.2f}")
    for row in survival:
        print(f"  λ = {row['λ']:g}: {row['kept']} heads kept, {row['role heads kept']} with a role "
              f"({row['share among kept']:.0%})")
    survival_test(found, "role_survival_p", roles[roles["type"] == "enc-self"], masks, list(ENCODER_ROLES), "a role")
    dec_enc_masks = sweep_masks(demo / "voita_dec_enc")
    if dec_enc_masks and analyzed.get("alignment_heads") is not None:
        print("Voita's gates on the encoder-decoder heads: " + ", ".join(
            f"λ = {lam:g} keeps {sum(map(sum, mask['dec-enc']))}" for lam, mask in sorted(dec_enc_masks.items())))
        survival_test(found, "alignment_survival_p", roles[roles["type"] == "dec-enc"], dec_enc_masks,
                      ["alignment"], "an alignment role")
    print("expected (scripts/demo_expected.json: the spread over training seeds):")
    for key, (low, high) in expected["ranges"].items():
        value = found.get(key)
        flag = "" if value is not None and low <= value <= high else "   <- outside the range"
        print(f"  {key}: {value if not isinstance(value, float) else round(value, 2)} (expected {low}..{high}){flag}")
    print(f"report: {demo / 'report' / 'report.html'} (and report.md)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/demo"))
