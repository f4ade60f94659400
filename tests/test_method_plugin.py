"""A pruning method is one module and one yaml: an order kept outside hprune runs through `prune` and `report`,
and a method that trains a mechanism of its own inside the model through `prune`, `export` (both formats, its
trained checkpoint in a fresh process) and `report`, with no hprune file edited."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from conftest import SMALL_DATA, hprune
from test_extension_points import EXTENSIONS, files_of

pytest.importorskip("fairseq")

MODULE = '''
from hprune.methods import register_method
from hprune.pruning import scores


@register_method("largest_first")
def largest_first(session, cfg):
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
    assert [files_of(plugin)] == EXTENSIONS["an order"]
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


# A method that trains: a learned scale per head (sigmoid of 50 x a logit) and a penalty on their sum;
# a head whose scale ends at or below 0.5 is pruned. Its mechanism (the plugin side: flags, installation, loss,
# read-out, slicing) and its method (settings, control, report) in one module.
TRAINED_MODULE = '''
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import pandas as pd
import torch
from fairseq.dataclass import FairseqDataclass
from torch import nn

from hprune.methods import Control, MethodSettings, Report, register_method
from hprune_fairseq.mechanisms import Mechanism, register_mechanism


@dataclass
class ScalesConfig(FairseqDataclass):
    head_scales: Optional[str] = field(default=None, metadata={"help": "a learned scale on these types' heads"})
    scale_penalty: float = field(default=0.0, metadata={"help": "weight of the scales' sum in the loss"})


class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.logit = nn.Parameter(torch.linspace(0.02, 0.2, n))  # heads started from 0.73 to 1.0

    def forward(self):
        return torch.sigmoid(50 * self.logit)

    def deterministic(self):
        value = torch.sigmoid(50 * self.logit.detach())
        return torch.where(value > 0.5, value, torch.zeros_like(value))

    def keep(self, local):
        self.logit = nn.Parameter(self.logit[local])


class HeadScales(Mechanism):
    name, config, logged = "head_scales", ScalesConfig, (("open_scales", 2),)

    def install(self, model, args):
        for kind, _, module in model.attention_modules():
            if kind in args.head_scales.split(","):
                module.gate = Scale(module.num_heads)
        model.scale_penalty = args.scale_penalty

    def present(self, model):
        return any(isinstance(m.gate, Scale) for _, _, m in model.attention_modules())

    def loss(self, model, training):
        scales = torch.cat([m.gate() for _, _, m in model.attention_modules() if isinstance(m.gate, Scale)])
        return model.scale_penalty * scales.sum(), {"open_scales": (scales > 0.5).sum().detach()}

    def upgrade_state_dict(self, model, state_dict, prefix):
        for name, module in model.named_modules():
            if isinstance(module, Scale) and f"{prefix}{name}.logit" not in state_dict:
                state_dict[f"{prefix}{name}.logit"] = module.logit.detach().clone()


register_mechanism(HeadScales())


@dataclass
class ScaleSettings(MethodSettings):
    scale_penalty: float = 1.0
    optim: Dict[str, Any] = field(default_factory=dict)
    finetune: Dict[str, Any] = field(default_factory=dict)
    export: bool = False


@register_method("head_scales", procedure=True, settings=ScaleSettings,
                 control=Control("no penalty", lambda p, metrics: p.scale_penalty == 0),
                 report=Report(knobs=("scale_penalty",), columns=("open_scales",),
                               heatmaps=(("scales.csv", "scale", "learned scales"),), title="Head scales"))
def head_scales(session, cfg, out):
    """Learned head scales with a penalty on their sum."""
    from hprune.evaluation import Evaluator
    from hprune.methods import trained

    p, start = cfg.prune, Evaluator.of(session, cfg)
    pool, unpruned = trained.unpruned(start, cfg, out)
    options = ["--head-scales", ",".join(p.types), "--scale-penalty", str(p.scale_penalty)]
    with trained.train(start, cfg, options, out, "scales") as (scaled, seconds):  # the start parked meanwhile
        rows = [{"type": kind, "layer": layer, "head": h, "scale": round(float(v), 6), "kept": int(v > 0)}
                for kind, layer, m in scaled.session.model.gated_modules()
                for h, v in zip(m.head_ids, m.gate.deterministic())]
        table, closed, mask, pruned = trained.read_out(scaled, pd.DataFrame(rows), "scale", p, out)
        table.to_csv(out / "scales.csv", index=False)
        metrics = {**trained.metrics(start, cfg, pool, closed, mask, pruned, unpruned, seconds),
                   "scale_penalty": p.scale_penalty, "open_scales": int(table["kept"].sum())}
        metrics.update(trained.finetune_and_export(start, scaled, cfg, mask, pruned, unpruned, out))
    return metrics
'''

TRAINED_YAML = """method: head_scales
module: {module}
types: [enc-self, dec-enc]
scale_penalty: 1.0
optim: {{optimizer: adam, lr: 0.01, lr_scheduler: fixed, max_tokens: 2048, max_update: 12, log_interval: 4,
        save_interval_updates: 12}}
finetune: {{updates: 0, lr: 1.0e-4, max_tokens: 2048}}
export: true
"""


def test_a_trained_method_with_a_mechanism_of_its_own_through_prune_export_and_report(trained_run, tmp_path):
    plugin = tmp_path / "plugin"
    (plugin / "prune").mkdir(parents=True)
    (plugin / "head_scales.py").write_text(TRAINED_MODULE)
    (plugin / "prune" / "head_scales.yaml").write_text(TRAINED_YAML.format(module=plugin / "head_scales.py"))
    runs = tmp_path / "runs"
    common = [f"ckpt={trained_run}", f"hydra.searchpath=[file://{plugin}]", *SMALL_DATA, "device=cpu"]
    for penalty in (0, 0.05):  # the control (no penalty), and the method
        hprune("prune", "--method", "head_scales", *common, f"prune.scale_penalty={penalty}",
               f"hydra.run.dir={runs}/scales_{penalty:g}")
    assert [files_of(plugin)] == EXTENSIONS["a trained method"]
    run = runs / "scales_0.05"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["method"] == "head_scales" and metrics["heads_pool"] == 24
    assert metrics["heads_pruned"] + metrics["kept_heads"] == 24 and metrics["open_scales"] == metrics["kept_heads"]
    assert metrics["export_same_translations"] and metrics["report_knobs"] == ["scale_penalty"]
    assert not json.loads((runs / "scales_0.05" / "metrics.json").read_text())["is_control"]
    assert json.loads((runs / "scales_0" / "metrics.json").read_text())["is_control"]
    assert "open_scales" in (run / "prune.log").read_text()  # the criterion logs what the mechanism declares

    # its trained checkpoint, mechanism unfolded, in a fresh process: the checkpoint says which module has it
    gated = run / "checkpoints" / "checkpoint_last.pt"
    hprune("export", f"ckpt={gated}", "format=fairseq", f"hydra.run.dir={tmp_path / 'fairseq'}", *SMALL_DATA,
           "device=cpu", subprocess=True)
    exported = json.loads((tmp_path / "fairseq" / "metrics.json").read_text())
    assert exported["export_same_translations"] and exported["n_params_pruned"] < exported["n_params"]
    hprune("export", f"ckpt={gated}", f"mask={run / 'head_mask.json'}", f"hydra.run.dir={tmp_path / 'ct2'}",
           *SMALL_DATA, "device=cpu")
    ct2 = json.loads((tmp_path / "ct2" / "metrics.json").read_text())
    assert ct2["parity_max_log_prob_diff"] < 1e-4 and ct2["bleu"] == pytest.approx(ct2["bleu_hprune"], abs=0.5)

    hprune("report", str(runs), f"hydra.run.dir={tmp_path / 'report'}")
    trained = pd.read_csv(tmp_path / "report" / "controlled.csv").set_index("run")
    assert {"scale_penalty", "open_scales", "bleu_control"} <= set(trained.columns)
    assert 0 < metrics["heads_pruned"] < 24  # the penalty closed some scales
    assert trained.loc["runs/scales_0.05", "bleu_control"] == pytest.approx(
        json.loads((runs / "scales_0" / "metrics.json").read_text())["bleu"])
    plots = {p.name for p in (tmp_path / "report" / "plots").iterdir()}
    assert any(name.startswith("head_scales_scale_penalty_") for name in plots), plots
    assert any(name.endswith("_scale.png") for name in plots), plots  # its declared per-head table
