"""The paper presets hold the papers' settings (`hprune <verb> experiment=X --cfg job`, as a user checks them),
and the launcher presets compose with their keys overridable."""
from __future__ import annotations

import pytest
import yaml

from conftest import hprune


def job_config(verb: str, *overrides: str) -> dict:
    return yaml.safe_load(hprune(verb, *overrides, "--cfg", "job").stdout)


def test_michel2019_prunes_the_published_wmt14_en_fr_big_with_newstest_importance_and_10_percent_steps():
    from hprune.data.published import BASE_URL, PUBLISHED
    fetch = job_config("data", "fetch", "experiment=michel2019")
    assert fetch["published"] == "wmt14.en-fr.joined-dict.transformer" and fetch["published"] in PUBLISHED
    assert BASE_URL + PUBLISHED[fetch["published"]].archive == \
        "https://dl.fbaipublicfiles.com/fairseq/models/wmt14.en-fr.joined-dict.transformer.tar.bz2"
    prune = job_config("prune", "experiment=michel2019")
    assert prune["ckpt"] == "${paths.models_root}/wmt14.en-fr.joined-dict.transformer/model.pt"
    assert prune["data"]["kind"] == "pretrained" and prune["data"]["bpe"] == "auto"
    assert prune["prune"]["method"] == "michel" and prune["prune"]["step_pct"] == 10
    assert prune["prune"]["importance"]["normalize_by_layer"] and not prune["prune"]["reestimate"]
    assert prune["prune"]["finetune"]["updates"] == 0
    test_sets = prune["data"]["test_sets"]
    splits = {"test" if i == 0 else f"test{i}": [name] for i, name in enumerate(test_sets)}
    splits.update(train=prune["data"]["train_sets"], valid=prune["data"]["valid_sets"])
    assert splits[prune["split"]] == ["wmt13"]  # BLEU on newstest2013
    importance = splits[prune["prune"]["importance"]["split"]]
    assert importance == ["wmt09", "wmt10", "wmt11", "wmt12"]  # on newstest, never on BLEU's
    assert (prune["generation"]["beam"], prune["generation"]["lenpen"]) == (5, 1.0)


def test_voita2019_is_en_ru_2_5m_base_with_frozen_decoder_encoder_gates():
    train = job_config("train", "experiment=voita2019")
    assert train["data"]["name"] == "wmt_en_ru" and train["data"]["subsample"] == 2_500_000
    assert (train["model"]["encoder_embed_dim"], train["model"]["encoder_attention_heads"]) == (512, 8)
    assert train["model"]["share_all_embeddings"] is False
    optim = train["optim"]
    # t2t_noam: 4.0 * 512^-0.5 * 16000^-0.5 is the peak lr, reached at the end of the 16k warm-up
    assert optim["lr"] == pytest.approx(4.0 * 512 ** -0.5 * 16000 ** -0.5, rel=0.01)
    assert (optim["warmup_updates"], optim["adam_betas"]) == (16000, "(0.9, 0.998)")
    assert optim["max_tokens"] * optim["update_freq"] == 16000
    prune = job_config("prune", "experiment=voita2019", "ckpt=x")
    assert prune["prune"]["method"] == "voita" and prune["prune"]["types"] == ["enc-self"]
    assert prune["prune"]["freeze_decoder"] is True and prune["prune"]["l0_normalize"] == "layer_mean"
    assert (prune["generation"]["beam"], prune["generation"]["lenpen"]) == (4, 0.6)
    # a method chosen on the command line wins over the preset's
    assert job_config("prune", "experiment=voita2019", "ckpt=x", "prune=michel")["prune"]["method"] == "michel"


def test_moa2022_is_wmt14_en_de_8k8e128d_with_averaging_and_beam_4():
    train = job_config("train", "experiment=moa2022")
    model, optim = train["model"], train["optim"]
    assert train["data"]["name"] == "wmt14_en_de" and train["data"]["test_sets"] == ["wmt14/full"]
    assert (model["moa_top_k"], model["moa_experts"], model["moa_head_dim"]) == (8, 8, 128)
    assert (model["dropout"], model["attention_dropout"], model["activation_dropout"]) == (0.2, 0.2, 0.1)
    assert (optim["lr"], optim["warmup_updates"], optim["label_smoothing"], optim["adam_eps"]) == (7e-4, 4000, 0.1, 1e-9)
    assert (optim["max_tokens"], optim["update_freq"], optim["max_epoch"]) == (8192, 32, 100)
    assert train["average_last"] == 10
    sparse = job_config("train", "experiment=moa2022", "model=moa_8k32e128d")["model"]
    assert (sparse["moa_top_k"], sparse["moa_experts"]) == (8, 32)
    evaluate = job_config("eval", "experiment=moa2022", "ckpt=x")
    assert (evaluate["generation"]["beam"], evaluate["generation"]["lenpen"]) == (4, 0.6)


def test_launcher_presets_compose_with_overridable_keys():
    hydra_cfg = yaml.safe_load(hprune("train", "hydra/launcher=slurm", "hydra.launcher.partition=gpu",
                                      "hydra.launcher.timeout_min=60", "hydra.launcher.gpus_per_node=8",
                                      "--cfg", "hydra").stdout)["hydra"]["launcher"]
    assert hydra_cfg["_target_"].endswith("SlurmLauncher")
    assert (hydra_cfg["partition"], hydra_cfg["timeout_min"], hydra_cfg["gpus_per_node"]) == ("gpu", 60, 8)
    assert hydra_cfg["max_num_timeout"] > 0  # requeued after a timeout, and training resumes
    local = yaml.safe_load(hprune("prune", "ckpt=x", "hydra/launcher=local", "hydra.launcher.n_jobs=2",
                                  "--cfg", "hydra").stdout)["hydra"]["launcher"]
    assert local["_target_"].endswith("JoblibLauncher") and local["n_jobs"] == 2
