"""`hprune analyze` end to end on the small model, checked against a direct computation, and bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import SMALL_DATA, hprune
from test_cli import assert_one_line_error

pytest.importorskip("fairseq")


def test_roles_table_summary_and_a_direct_check(trained_run, evaluated_run, tmp_path):
    from hprune import backend
    out = tmp_path / "run"
    mask = {kind: [[1, 0, 1, 1]] * 3 for kind in ("enc-self", "dec-self", "dec-enc")}
    (tmp_path / "mask.json").write_text(json.dumps(mask))
    hprune("analyze", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           f"mask={tmp_path / 'mask.json'}", subprocess=True)  # the analyze verb as its own process
    roles = pd.read_csv(out / "head_roles.csv")
    assert len(roles) == 36 and roles["confidence"].between(0, 1).all()
    enc = roles[roles["type"] == "enc-self"]
    assert enc["positional_prev"].notna().all() and "nsubj_dep->head" in roles.columns
    assert (enc["alive"] == [1, 0, 1, 1] * 3).all()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["syntactic_heads"] == int(enc["syntactic"].sum())
    assert "survived the mask" in (out / "summary.txt").read_text()
    for measure in ("confidence", "positional_prev", "rare_token"):
        assert (out / f"roles_{measure}.png").stat().st_size > 5_000

    # a second implementation: each raw sentence alone (no batching, no padding), previous-token and
    # rare-word shares of every enc-self head
    loaded = backend.load_model(trained_run / "checkpoints" / "checkpoint_best.pt", Path(evaluated_run[1]["data_bin"]))
    dictionary = loaded.task.source_dictionary
    modules = [layer.self_attn for layer in loaded.model.encoder.layers]
    loaded.model.record_heads(weights=True)
    previous, rare, queries = torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.float64), 0
    raw = Path(evaluated_run[1]["data_bin"]).parent / "pieces" / "valid.src"  # what the model reads
    for line in raw.read_text().splitlines():
        tokens = dictionary.encode_line(line, add_if_not_exist=False).long()
        counts = [dictionary.count[t] for t in tokens[:-1].tolist()]
        rarest = counts.index(min(counts))
        with torch.no_grad():
            loaded.model.encoder(tokens.unsqueeze(0), src_lengths=torch.tensor([len(tokens)]))
        for layer, module in enumerate(modules):
            argmax = module.head_weights[0, :, :-1].argmax(-1)  # (heads, words)
            previous[layer] += (argmax == torch.arange(argmax.size(1)) - 1).sum(-1)
            rare[layer] += (argmax == rarest).sum(-1)
        queries += len(tokens) - 1
    for column, expected in (("positional_prev", previous), ("rare_token", rare)):
        ours = torch.tensor(enc.sort_values(["layer", "head"])[column].to_numpy()).view(3, 4)
        torch.testing.assert_close(ours, expected / queries, atol=1e-12, rtol=0)


def test_bad_input(trained_run, tmp_path):
    bad_mask = tmp_path / "mask.json"
    bad_mask.write_text(json.dumps({"enc-self": [[1, 1]]}))
    args = [f"ckpt={trained_run}", f"hydra.run.dir={tmp_path / 'run'}", *SMALL_DATA, "device=cpu"]
    assert_one_line_error(hprune("analyze", *args, f"mask={bad_mask}", check=False), "does not fit this model")
    assert_one_line_error(hprune("analyze", *args, f"arcs={tmp_path / 'none.jsonl'}", check=False),
                          "none.jsonl does not exist")
    assert not (tmp_path / "run" / "head_roles.csv").exists()
