"""A data kind and an export format are each one module (and, for a data kind, one yaml; for a format with settings
of its own, one yaml), registered where they live and found through a config key (`data.module`,
`format_module`): kept outside hprune, they run through `hprune data prepare` and `hprune export` with no hprune
file edited. The files each extension is are what docs/development.md's table ("Extensions") says: the table is
read here and set against the files the tests build (here and in test_method_plugin.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import SMALL_DATA, hprune
from test_cli import assert_one_line_error
from test_layout import HF_FAMILY_HOMES

pytest.importorskip("fairseq")

DOCS = Path(__file__).resolve().parents[1] / "docs" / "development.md"
# the files of each extension kept outside hprune, as the tests build them (one list per test)
EXTENSIONS = {
    "an order": [["largest_first.py", "prune/largest_first.yaml"]],
    "a trained method": [["head_scales.py", "prune/head_scales.yaml"]],
    "a data kind": [["data/tsv.yaml", "tsv_kind.py"]],
    "an export format": [["state_dict_format.py"], ["export/state_dict.yaml", "state_dict_format.py"]],
}


def files_of(folder: Path) -> list[str]:
    """The files an extension kept in `folder` is (Python's bytecode caches aside)."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*")
                  if path.is_file() and "__pycache__" not in path.parts)


def counted(files: list[str]) -> str:
    """The files as the table counts them: `1 module`, `1 module + 1 yaml`."""
    modules, yamls = sum(f.endswith(".py") for f in files), sum(f.endswith(".yaml") for f in files)
    assert modules + yamls == len(files), files
    return " + ".join(f"{n} {word}{'s' if n > 1 else ''}" for n, word in ((modules, "module"), (yamls, "yaml")) if n)


def extension_table() -> dict[str, str]:
    """docs/development.md's table: each extension's first column -> its files column."""
    section = DOCS.read_text().split("## Extensions: the files each touches", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| extension")]
    return {row[0]: row[1] for row in rows}


def test_the_extension_table_counts_the_files_the_tests_build():
    table = extension_table()
    for extension, builds in EXTENSIONS.items():
        (row,) = [files for name, files in table.items() if name.startswith(extension)]
        for files in builds:
            assert counted(files) in row, (extension, counted(files), row)
        assert "no hprune file" in row, (extension, row)
    (family,) = [files for name, files in table.items() if name.startswith("a Hugging Face family")]
    assert re.match(rf"{len(HF_FAMILY_HOMES)} hprune modules", family), family

KIND = '''
import hashlib
from pathlib import Path

from hprune import backend
from hprune.data.kinds import DataKind, register_kind
from hprune.errors import UserError

SPLITS = ("train", "valid", "test")


def key(data):
    digest = hashlib.sha256()
    for split in SPLITS:
        digest.update((Path(data.path) / f"{split}.tsv").read_bytes())
    return digest.hexdigest()[:12]


def check(data):
    missing = [s for s in SPLITS if not (Path(data.path) / f"{s}.tsv").is_file()]
    if missing:
        raise UserError(f"data.path={data.path} lacks {', '.join(s + '.tsv' for s in missing)}")


def build(data, data_root, staging):
    text, raw = staging / "text", staging / "raw"
    text.mkdir()
    raw.mkdir()
    for split in SPLITS:
        pairs = [line.split("\\t") for line in (Path(data.path) / f"{split}.tsv").read_text().splitlines()]
        for side, lang in enumerate((data.src_lang, data.tgt_lang)):
            lines = "".join(pair[side].strip() + "\\n" for pair in pairs)
            (text / f"{split}.{lang}").write_text(lines)
            (raw / f"{split}.{lang}").write_text(lines)
    backend.binarize(text, staging / "bin", data.src_lang, data.tgt_lang)
    return {}


register_kind(DataKind("tsv", key=key, check=check, build=build))
'''

KIND_YAML = """name: tsv
kind: tsv
module: {module}
path: {path}
src_lang: en
tgt_lang: de
post_process: null
tokenizer: null
"""

PAIRS = {"train": [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schläft"),
                   ("a small cat", "eine kleine Katze")],
         "valid": [("the cat is small", "die Katze ist klein")],
         "test": [("the house sleeps", "das Haus schläft"), ("a cat", "eine Katze")]}


def test_a_data_kind_from_its_own_module_and_yaml(tmp_path):
    plugin, corpus, root = tmp_path / "plugin", tmp_path / "corpus", tmp_path / "data-root"
    (plugin / "data").mkdir(parents=True)
    corpus.mkdir()
    for split, pairs in PAIRS.items():
        (corpus / f"{split}.tsv").write_text("".join(f"{en}\t{de}\n" for en, de in pairs))
    (plugin / "tsv_kind.py").write_text(KIND)
    (plugin / "data" / "tsv.yaml").write_text(KIND_YAML.format(module=plugin / "tsv_kind.py", path=corpus))
    args = ["data", "prepare", "data=tsv", f"hydra.searchpath=[file://{plugin}]", f"paths.data_root={root}",
            f"hydra.run.dir={tmp_path / 'run'}"]
    hprune(*args)
    assert [files_of(plugin)] == EXTENSIONS["a data kind"]
    (folder,) = root.glob("tsv-*")
    assert (folder / "READY").exists()
    assert (folder / "raw" / "test.de").read_text().splitlines() == [de for _, de in PAIRS["test"]]
    words = {line.split()[0] for line in (folder / "bin" / "dict.en.txt").read_text().splitlines()}
    assert {"house", "cat", "small"} <= words  # fairseq-preprocess saw the source side of the TSV

    from fairseq.data import Dictionary, data_utils
    dictionary = Dictionary.load(str(folder / "bin" / "dict.de.txt"))
    test = data_utils.load_indexed_dataset(str(folder / "bin" / "test.en-de.de"), dictionary)
    assert [dictionary.string(test[i][:-1]) for i in range(len(test))] == [de for _, de in PAIRS["test"]]

    (corpus / "valid.tsv").unlink()  # the kind's own check: one line, nothing built
    proc = hprune(*args[:-2], f"paths.data_root={tmp_path / 'other-root'}", f"hydra.run.dir={tmp_path / 'bad'}",
                  check=False)
    assert_one_line_error(proc, "lacks valid.tsv")
    assert not list((tmp_path / "other-root").glob("tsv-*"))
    proc = hprune(*args[:-1], "data.kind=tsv_elsewhere", "data.module=no_such_kind_module",
                  f"hydra.run.dir={tmp_path / 'bad2'}", check=False)
    assert_one_line_error(proc, "data.module=no_such_kind_module")


FORMAT = '''
import torch

from hprune.deploy import register_exporter


@register_exporter("state_dict")
def export(evaluator, mask, out, cfg):
    """The pruned model's weights as a plain state dict, checked against the masked model's outputs."""
    session, measure = evaluator.session, evaluator.measure
    pruned = session.pruned_copy(mask)
    sample = next(session.batches(measure.loss_split, measure.max_tokens, 1))
    with torch.no_grad(), session.masked(mask):
        masked = session.model(**sample["net_input"])[0].float()
        difference = (pruned(**sample["net_input"])[0].float() - masked).abs().max().item()
    torch.save(pruned.state_dict(), out / cfg.get("state_dict_file", "pruned_state.pt"))
    return {"state_dict_max_abs_diff": difference, "state_dict_params": sum(p.numel() for p in pruned.parameters())}
'''

# the same format with a setting of its own: its option of the export group, which `format=state_dict` selects
FORMAT_YAML = """# @package _global_
format: state_dict
format_module: {module}
state_dict_file: weights.pt
"""


def test_an_export_format_from_its_own_module(trained_run, evaluated_run, tmp_path):
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "state_dict_format.py").write_text(FORMAT)
    mask = {kind: [[1, 1, 1, 1] for _ in range(3)] for kind in ("enc-self", "dec-self", "dec-enc")}
    mask["enc-self"][0] = [1, 0, 0, 1]
    mask["dec-enc"][2] = [0, 1, 1, 1]
    (tmp_path / "head_mask.json").write_text(json.dumps(mask))
    out = tmp_path / "export"
    hprune("export", f"ckpt={trained_run}", f"mask={tmp_path / 'head_mask.json'}", "format=state_dict",
           f"format_module={plugin / 'state_dict_format.py'}", f"hydra.run.dir={out}", *SMALL_DATA, "device=cpu")
    assert files_of(plugin) == EXTENSIONS["an export format"][0]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["format"] == "state_dict" and metrics["state_dict_max_abs_diff"] < 1e-4
    assert metrics["state_dict_params"] < evaluated_run[1]["n_params"] == metrics["n_params"]
    state = torch.load(out / "pruned_state.pt", weights_only=True)
    head_dim = state["encoder.layers.1.self_attn.q_proj.weight"].shape[0] // 4
    assert state["encoder.layers.0.self_attn.q_proj.weight"].shape[0] == 2 * head_dim
    assert state["decoder.layers.2.encoder_attn.q_proj.weight"].shape[0] == 3 * head_dim

    # with a yaml holding its settings (and its module), found through hydra.searchpath as a method's is
    (plugin / "export").mkdir()
    (plugin / "export" / "state_dict.yaml").write_text(FORMAT_YAML.format(module=plugin / "state_dict_format.py"))
    configured = tmp_path / "configured"
    hprune("export", f"ckpt={trained_run}", f"mask={tmp_path / 'head_mask.json'}", "format=state_dict",
           f"hydra.searchpath=[file://{plugin}]", f"hydra.run.dir={configured}", *SMALL_DATA, "device=cpu")
    assert files_of(plugin) == EXTENSIONS["an export format"][1]
    assert json.loads((configured / "metrics.json").read_text())["format"] == "state_dict"
    assert torch.load(configured / "weights.pt", weights_only=True).keys() == state.keys()
    composed = (configured / ".hydra" / "config.yaml").read_text()
    assert "state_dict_file: weights.pt" in composed and "quantization" not in composed  # its settings alone

    proc = hprune("export", f"ckpt={trained_run}", "format=onnx", f"hydra.run.dir={tmp_path / 'bad'}", *SMALL_DATA,
                  "device=cpu", check=False)
    assert_one_line_error(proc, "format=onnx", "ctranslate2", "fairseq")
