"""A pruning method is one module and one yaml: one kept outside hprune runs through `prune` and `report` with
no other file edited."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from conftest import SMALL_DATA, hprune

pytest.importorskip("fairseq")

MODULE = '''
from hprune.methods import register_method
from hprune.pruning import scores


@register_method("largest_first")
def largest_first(session, p):
    """The heads of largest q/k/v weights first: magnitude's order reversed."""
    table = scores.magnitude(session.model)
    table["importance"] = -table["importance"]
    return table
'''


def test_a_method_from_its_own_module_and_yaml_through_prune_and_report(trained_run, tmp_path):
    plugin = tmp_path / "plugin"
    (plugin / "prune").mkdir(parents=True)
    (plugin / "largest_first.py").write_text(MODULE)
    (plugin / "prune" / "largest_first.yaml").write_text(
        f"defaults: [michel, _self_]\nmethod: largest_first\nmodule: {plugin / 'largest_first.py'}\n")
    runs = tmp_path / "runs"
    hprune("prune", "--method", "largest_first", f"ckpt={trained_run}", f"hydra.searchpath=[file://{plugin}]",
           "prune.step_pct=50", "prune.target_pct=50", "prune.baselines=[magnitude]", f"hydra.run.dir={runs}/prune",
           *SMALL_DATA, "device=cpu")
    # the half of the heads pruned is the half with the largest magnitude
    magnitude = pd.read_csv(runs / "prune" / "head_importance.csv")
    assert (magnitude["importance"] <= 0).all()
    largest = set(magnitude.nsmallest(18, "importance")[["type", "layer", "head"]].itertuples(index=False, name=None))
    mask = json.loads((runs / "prune" / "head_mask.json").read_text())
    pruned = {(kind, layer, h) for kind, layers in mask.items() for layer, heads in enumerate(layers)
              for h, alive in enumerate(heads) if not alive}
    assert pruned == largest
    metrics = json.loads((runs / "prune" / "metrics.json").read_text())
    assert metrics["method"] == "largest_first" and metrics["pct_pruned"] == 50.0

    hprune("report", str(runs), f"hydra.run.dir={tmp_path / 'report'}")
    comparison = pd.read_csv(tmp_path / "report" / "comparison.csv").set_index("method")
    assert {"largest_first", "magnitude"} <= set(comparison.index)
    assert comparison.loc["largest_first", "BLEU@50%"] == pytest.approx(metrics["bleu"])


def test_a_method_module_that_cannot_be_imported(trained_run, tmp_path):
    plugin = tmp_path / "plugin"
    (plugin / "prune").mkdir(parents=True)
    (plugin / "prune" / "gone.yaml").write_text("defaults: [michel, _self_]\nmethod: gone\nmodule: no_such_module_here\n")
    proc = hprune("prune", "--method", "gone", f"ckpt={trained_run}", f"hydra.searchpath=[file://{plugin}]",
                  f"hydra.run.dir={tmp_path / 'run'}", *SMALL_DATA, "device=cpu", check=False)
    assert proc.returncode == 2 and "prune.module=no_such_module_here" in proc.stderr
    assert not (tmp_path / "run" / "metrics.json").exists()
