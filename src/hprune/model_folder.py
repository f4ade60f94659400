"""A model folder, the one home of what hprune reads and writes in a folder that holds a model (below both data/
and backend/; light: no torch, no fairseq).

- `hprune.yaml`: the model's data settings (test, valid and train sets, tokenizer, bpe) and where it came from
  (`source`). `hprune data fetch published=NAME` and the Hugging Face import write it; data=pretrained reads it.
  A folder with it says what it is: verbs given such a checkpoint need no `data=` (checkpoint_ref.py tells,
  hprune_cli adds data=pretrained). A checkpoint's model folder is the one it lies in (folder_of).
- A Hugging Face folder (what save_pretrained writes, or a Hub snapshot): config.json, the weights, and each
  family's tokenizer files.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .errors import UserError
from .registry import Registry

SETTINGS_FILE = "hprune.yaml"
# what hprune.yaml may hold, and `source`; a prefix where a model of one language pair starts its sentences with a
# token (Marian's >>fra<<: a multilingual model's come from its languages)
SETTINGS = ("test_sets", "valid_sets", "train_sets", "tokenizer", "bpe", "source_prefix", "target_prefix")
LANGUAGES = "languages"  # and, for a multilingual model, its language codes: {code: the token that marks it}
HF_CONFIG = "config.json"
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # in the order they are looked for
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a Hugging Face Hub repository, ORG/NAME


@dataclass(frozen=True)
class HfFamily:
    model_class: str
    files: tuple[str, ...]              # the tokenizer's files, all needed
    optional: tuple[str, ...] = ()      # read where present
    one_of: tuple[str, ...] = ()        # at least one needed (all read where present)
    # (folder, config, staging) -> hprune.yaml settings: attached by backend/hf.py, beside torch
    importer: Optional[Callable[[Path, dict, Path], dict]] = None

    def missing(self, present: set) -> list[str]:
        """What a folder or repository holding `present` (file names) lacks, as names to say."""
        missing = [name for name in self.files if name not in present]
        if self.one_of and not any(name in present for name in self.one_of):
            missing.append(" or ".join(self.one_of))
        return missing


# the families hprune imports, by config.json's model_type, each described by its model class
HF_FAMILIES: Registry[HfFamily] = Registry("Hugging Face family")
for _model_type, _family in {
    "fsmt": HfFamily("FSMTForConditionalGeneration", ("vocab-src.json", "vocab-tgt.json", "merges.txt"),
                     ("tokenizer_config.json", "generation_config.json")),
    "marian": HfFamily("MarianMTModel", ("source.spm", "target.spm", "vocab.json"),
                       ("tokenizer_config.json", "generation_config.json", "target_vocab.json")),
    # M2M100 and NLLB-200 (an M2M100 model with NLLB's tokenizer): the ids in vocab.json (M2M100) or tokenizer.json;
    # the sentencepiece model, or (NLLB, mBART-50 as transformers 5 saves them) tokenizer.json alone, which
    # backend/hf.py turns into one
    "m2m_100": HfFamily("M2M100ForConditionalGeneration", (),
                        ("vocab.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"),
                        ("sentencepiece.bpe.model", "tokenizer.json")),
    "mbart": HfFamily("MBartForConditionalGeneration", (),
                      ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json"),
                      ("sentencepiece.bpe.model", "tokenizer.json")),
}.items():
    HF_FAMILIES.add(_model_type, _family, _family.model_class)


def read_settings(folder: Path) -> dict:
    from omegaconf import OmegaConf

    path = Path(folder) / SETTINGS_FILE
    if not path.is_file():
        return {}
    settings = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
    unknown = set(settings) - set(SETTINGS) - {"source", LANGUAGES}
    if unknown:
        raise UserError(f"{path}: unknown setting(s) {sorted(unknown)}; it may hold {', '.join(SETTINGS)}")
    return settings


def write_settings(folder: Path, settings: dict) -> None:
    from omegaconf import OmegaConf

    from .files import write_atomic

    write_atomic(Path(folder) / SETTINGS_FILE, OmegaConf.to_yaml(OmegaConf.create(settings)))


def is_hf_dir(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / HF_CONFIG).is_file()


def read_hf_config(folder: Path) -> dict:
    try:
        return json.loads((Path(folder) / HF_CONFIG).read_text())
    except ValueError as err:
        raise UserError(f"{folder}/{HF_CONFIG} is not JSON ({err}); pass the folder save_pretrained wrote") from None


def hf_family(config: dict, where) -> str:
    family = config.get("model_type")
    if family not in HF_FAMILIES:
        raise UserError(f"{where} holds a Hugging Face '{family}' model; hprune imports the translation models "
                        f"{', '.join(f.model_class for f in HF_FAMILIES.values())}")
    return family


def folder_of(checkpoint: Path) -> Path:
    """The model folder a checkpoint file belongs to: the one it lies in, where a published model's model.pt, an
    import's and a pruned copy of either find their dictionaries, codes and hprune.yaml."""
    return Path(checkpoint).parent
