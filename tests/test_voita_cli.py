"""`hprune prune --method voita` end to end on the small model, and its answers to bad input."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from conftest import SMALL_DATA, hprune
from test_cli import assert_one_line_error
from test_prune_cli import run_error

pytest.importorskip("fairseq")
SHORT = ["prune.optim.max_update=60", "prune.optim.log_interval=10", "prune.optim.warmup_updates=0",
         "prune.gate_init=0.0"]


def voita(trained_run, out, *extra):
    hprune("prune", "--method", "voita", f"ckpt={trained_run}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu",
           *SHORT, *extra)
    return json.loads((out / "metrics.json").read_text()), pd.read_csv(out / "gates.csv")


def test_a_large_penalty_closes_every_gate_and_the_mask_reproduces_them(trained_run, tmp_path):
    metrics, gates = voita(trained_run, tmp_path / "run", "prune.l0_lambda=20", "prune.optim.lr=0.05")
    assert len(gates) == 12 and (gates["gate"] == 0).all() and (gates["alive"] == 0).all()
    assert (gates["p_open"] < 0.5).all()
    assert metrics["alive_gated_heads"] == 0 and metrics["kept_enc_self"] == 0 and metrics["kept_dec_enc"] == 12
    assert metrics["gates_binary"] and metrics["bleu"] == metrics["bleu_gates"]  # read-out == the gates
    mask = json.loads((tmp_path / "run" / "head_mask.json").read_text())
    assert mask["enc-self"] == [[0] * 4] * 3 and mask["dec-self"] == [[1] * 4] * 3
    alive = pd.read_csv(tmp_path / "run" / "alive_heads.csv")
    assert list(alive["num_updates"]) == [10, 20, 30, 40, 50, 60] and alive["alive_heads"].iloc[-1] == 0
    for plot in ("gates.png", "alive_heads.png"):
        assert (tmp_path / "run" / plot).stat().st_size > 5_000


def test_no_penalty_closes_no_gate(trained_run, tmp_path):
    metrics, gates = voita(trained_run, tmp_path / "run", "prune.l0_lambda=0", "prune.optim.lr=0.001",
                           "prune.types=[enc-self,dec-enc]", "prune.freeze_decoder=false")
    assert len(gates) == 24 and (gates["gate"] > 0).all()
    assert metrics["alive_gated_heads"] == 24 and metrics["pct_pruned"] == 0


@pytest.mark.parametrize("extra,expected", [
    (["prune.l0_lambda=-0.1"], "prune.l0_lambda=-0.1 is negative"),
    (["prune.types=[enc-self,cross]"], "unknown attention type(s) ['cross']"),
    (["prune.types=[dec-enc]"], "prune.freeze_decoder=true trains only the encoder"),
])
def test_bad_settings(trained_run, tmp_path, extra, expected):
    assert_one_line_error(run_error(trained_run, tmp_path, "prune=voita", *extra), expected)
