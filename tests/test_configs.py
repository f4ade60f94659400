"""Every option of every config group composes, through Hydra's compose API."""
from pathlib import Path

import hprune_configs
import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

CONFIG_DIR = Path(hprune_configs.__file__).parent
GROUPS = {"train": ["data", "model", "optim", "experiment"], "eval": ["data", "generation", "experiment"],
          "data": ["data", "experiment"], "prune": ["prune", "data", "generation", "experiment"],
          "analyze": ["data", "experiment"], "export": ["export", "data", "generation", "experiment"],
          "recover": ["recovery", "data", "generation", "experiment"]}


def options(group):
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


CASES = [(verb, group, option) for verb, groups in GROUPS.items() for group in groups for option in options(group)]


@pytest.fixture(autouse=True)
def clean_hydra():
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


@pytest.mark.parametrize("verb,group,option", CASES, ids=[f"{v}-{g}={o}" for v, g, o in CASES])
def test_option_composes(verb, group, option):
    with initialize_config_module(config_module="hprune_configs", version_base="1.3"):
        cfg = compose(config_name=verb, overrides=[f"{group}={option}"], return_hydra_config=True)
    assert cfg.verb == verb
    assert cfg.get("device", "auto") in ("auto", "cpu", "cuda")
    if group == "model":
        assert cfg.model.encoder_embed_dim % cfg.model.encoder_attention_heads == 0


def test_model_presets_have_paper_dimensions():
    expected = {"transformer_base": (512, 2048, 6, 8), "transformer_big": (1024, 4096, 6, 16)}
    with initialize_config_module(config_module="hprune_configs", version_base="1.3"):
        for name, dims in expected.items():
            m = compose(config_name="train", overrides=[f"model={name}"]).model
            assert (m.encoder_embed_dim, m.encoder_ffn_embed_dim, m.encoder_layers, m.encoder_attention_heads) == dims
            assert (m.decoder_embed_dim, m.decoder_ffn_embed_dim, m.decoder_layers, m.decoder_attention_heads) == dims


def test_experiment_holds_only_deltas():
    with initialize_config_module(config_module="hprune_configs", version_base="1.3"):
        base = compose(config_name="train")
        smoke = compose(config_name="train", overrides=["experiment=gpu_smoke"])
    assert smoke.model.encoder_embed_dim == 512 and smoke.optim.max_update == 300
    assert smoke.optim.label_smoothing == base.optim.label_smoothing  # untouched keys come from the defaults


def test_train_config_maps_to_fairseq_flags(tmp_path):
    from hprune.backend import train_argv
    with initialize_config_module(config_module="hprune_configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["device=cpu", "optim.max_update=7"])
    argv = train_argv(cfg, tmp_path / "bin", tmp_path / "ckpt")
    joined = " ".join(argv)
    assert "--arch hprune_transformer" in joined and "--max-update 7" in joined
    assert "--share-all-embeddings" in argv and "--cpu" in argv and "--max-epoch" not in argv
    assert argv[argv.index("--adam-betas") + 1] == "(0.9, 0.98)"


def _inheriting_michel():
    """The orders whose yaml holds only deltas from michel's (defaults: [michel, ...])."""
    import yaml

    return sorted(path.stem for path in (CONFIG_DIR / "prune").glob("*.yaml")
                  if "michel" in (yaml.safe_load(path.read_text()).get("defaults") or []))


@pytest.mark.parametrize("method", _inheriting_michel())
def test_orders_inherit_the_michel_settings(method):
    """An order's yaml that starts from michel's changes only what it says (its method; lrp: its own keys)."""
    import yaml

    own = set(yaml.safe_load((CONFIG_DIR / "prune" / f"{method}.yaml").read_text())) - {"defaults"}
    with initialize_config_module(config_module="hprune_configs", version_base="1.3"):
        michel = compose(config_name="prune", overrides=["ckpt=x"])
        other = compose(config_name="prune", overrides=["ckpt=x", f"prune={method}", "prune.step_pct=5"])
    assert other.prune.method == method and other.prune.step_pct == 5
    assert {k: v for k, v in other.prune.items() if k not in own | {"method", "step_pct"}} == \
           {k: v for k, v in michel.prune.items() if k not in own | {"method", "step_pct"}}


def test_every_prune_config_names_a_registered_method_and_back():
    """One name per method: configs/prune/<name>.yaml says `method: <name>`, and the registry holds exactly those;
    every method has its one-line summary, every procedure its settings check, and docs/methods.md names it."""
    pytest.importorskip("fairseq")
    from omegaconf import OmegaConf

    from hprune.errors import UserError
    from hprune.methods import METHODS, get_method, method_names
    configs = {path.stem: OmegaConf.load(path).method for path in (CONFIG_DIR / "prune").glob("*.yaml")}
    assert all(stem == method for stem, method in configs.items()), configs
    assert sorted(configs) == sorted(method_names())
    docs = (CONFIG_DIR.parent / "docs" / "methods.md").read_text()
    for name in method_names():
        method = METHODS[name]
        assert method.summary, f"{name}: its function has no docstring"
        assert f"`{name}`" in docs or f"--method {name}" in docs, f"docs/methods.md does not name {name}"
        assert (method.check is not None) == method.procedure, name  # orders: the curve's own check
        assert method.control is None or method.procedure, name
    with pytest.raises(UserError, match="unknown pruning method 'taylor'; choose from"):
        get_method("taylor")


def test_export_formats_are_the_export_group_and_the_registry():
    """One name per format: configs/export/<name>.yaml says `format: <name>`, the registry holds exactly those, and
    each describes itself (docs/deploy.md names it)."""
    pytest.importorskip("fairseq")
    from omegaconf import OmegaConf

    from hprune.deploy import EXPORTERS
    configs = {path.stem: OmegaConf.load(path).format for path in (CONFIG_DIR / "export").glob("*.yaml")}
    assert all(stem == name for stem, name in configs.items()), configs
    assert sorted(configs) == sorted(EXPORTERS.names())
    docs = (CONFIG_DIR.parent / "docs" / "deploy.md").read_text()
    for name, summary in EXPORTERS.describe():
        assert summary, f"format {name}: its function has no docstring"
        assert f"format={name}" in docs, f"docs/deploy.md does not name format={name}"


def test_data_kinds_are_the_registry():
    """Every data config names a registered kind, and every kind has a data config and describes itself."""
    from hprune.data.kinds import KINDS
    with initialize_config_module(config_module="hprune_configs", version_base="1.3"):
        kinds = {compose(config_name="data", overrides=[f"data={option}"]).data.kind for option in options("data")}
    assert kinds == set(KINDS.names())
    assert all(summary for _, summary in KINDS.describe()), KINDS.describe()
