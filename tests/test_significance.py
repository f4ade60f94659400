"""Paired bootstrap (reporting/significance.py) against sacreBLEU's command line on the same files."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hprune.reporting.significance import paired_bootstrap

WORDS = "the a cat dog sat ran on under mat house green small big red runs quickly slowly".split()


def corpus(seed: int, n: int = 120) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n)]


def degrade(lines: list[str], every: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(w for w in line.split() if rng.random() > 0.3) if i % every == 0 else line
            for i, line in enumerate(lines)]


def sacrebleu_cli(folder: Path, references, baseline, system, resamples: int, seed: int) -> list:
    """`sacrebleu REF -i BASE SYS --paired-bs` on files written into folder: its JSON, one entry per system."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, lines in (("ref", references), ("base", baseline), ("sys", system)):
        (folder / name).write_text("".join(line + "\n" for line in lines))
    cli = Path(sys.executable).with_name("sacrebleu")
    out = subprocess.run([str(cli), str(folder / "ref"), "-i", str(folder / "base"), str(folder / "sys"),
                          "--paired-bs", "--paired-bs-n", str(resamples), "-f", "json"], capture_output=True,
                         text=True, env={**os.environ, "SACREBLEU_SEED": str(seed)}, check=True).stdout
    return json.loads(out)


def test_paired_bootstrap_equals_sacrebleu_paired_bs(tmp_path):
    references = corpus(1)
    baseline, system = degrade(references, 2, 2), degrade(references, 5, 3)
    theirs = sacrebleu_cli(tmp_path, references, baseline, system, 300, 7)
    ours = paired_bootstrap(baseline, system, references, resamples=300, seed=7)
    assert ours["reference_bleu"] == pytest.approx(theirs[0]["BLEU"]["score"], abs=1e-9)
    assert ours["reference_bleu_ci95"] == pytest.approx(theirs[0]["BLEU"]["ci"], abs=1e-9)
    for key, field in (("bleu", "score"), ("bleu_mean", "mean"), ("bleu_ci95", "ci"), ("p_value", "p_value")):
        assert ours[key] == pytest.approx(theirs[1]["BLEU"][field], abs=1e-9), key
    assert ours["significant"] and ours["delta"] > 0 and "bs:300" in ours["signature"]
    assert os.environ.get("SACREBLEU_SEED") is None  # set for the call only


def test_same_translations_are_not_significant_and_unpaired_input_is_refused():
    references = corpus(4, 60)
    system = degrade(references, 3, 5)
    same = paired_bootstrap(system, system, references, resamples=100)
    assert same["delta"] == 0 and not same["significant"] and same["p_value"] == 1.0  # sacreBLEU's would be 1/101
    assert paired_bootstrap(system, system, references, resamples=100) == same  # seeded
    with pytest.raises(ValueError, match="the same sentences"):
        paired_bootstrap(system, system[:-1], references)
