"""The default configuration (what `make demo` runs) reaches BLEU >= 90 on the synthetic test set."""
import json

import pytest

from conftest import hprune


@pytest.mark.slow
def test_default_tiny_model_reaches_bleu_90(tmp_path):
    hprune("train", f"hydra.run.dir={tmp_path}", "device=cpu", timeout=1200)
    hprune("eval", f"ckpt={tmp_path}", f"hydra.run.dir={tmp_path / 'eval'}", "device=cpu")
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["sentences"] == 400
    assert metrics["bleu"] >= 90, metrics
