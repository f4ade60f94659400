"""Hugging Face translation models imported as fairseq model folders (model.pt, dict.<lang>.txt, bpecodes), which
every verb then takes as it takes a published fairseq model (data=pretrained).

FSMT (`FSMTForConditionalGeneration`, fairseq's WMT19 models as transformers ships them) is fairseq's
Transformer with `model.` before every key and rewritten vocabularies; both are turned back:
  - weights: `model.<fairseq key>` -> `<fairseq key>`; the sinusoidal position tables are recomputed by fairseq
  - vocabularies (vocab-src.json, vocab-tgt.json): ids 0-3 are fairseq's specials, a word-final piece `ab</w>`
    is fairseq's `ab`, any other piece `ab` is fairseq's `ab@@`; ids are kept, so no weight row moves
  - merges.txt: subword-nmt (version 0.2) codes, the same merge rule FSMT's tokenizer applies

Weights are read with safetensors (no pickle) or, for an older `pytorch_model.bin`, with torch's weights-only
unpickler; transformers itself is not needed to import.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from ..errors import UserError
from ..files import write_atomic

HF_FILES = ("config.json",)
FAMILIES = ("fsmt",)
FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish", "tanh": "tanh"}
INSTALL = "pip install 'hprune[hf]'"


def is_hf_dir(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def _config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except ValueError as err:
        raise UserError(f"{folder}/config.json is not JSON ({err}); pass the folder save_pretrained wrote") from None


def _weights(folder: Path) -> dict:
    if (folder / "model.safetensors").is_file():
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise UserError(f"{folder} holds safetensors weights, which need the safetensors package: "
                            f"{INSTALL}") from None
        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise UserError(f"{folder} has no model.safetensors or pytorch_model.bin; pass the folder save_pretrained wrote")


def _fingerprint(folder: Path) -> str:
    files = sorted(p for p in folder.iterdir() if p.is_file())
    key = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha1(json.dumps([str(folder.absolute()), key]).encode()).hexdigest()[:12]


def _fairseq_tokens(vocab: dict, path: Path) -> list[str]:
    """fairseq's dictionary order (ids 4...) from an FSMT vocabulary, each piece in fairseq's spelling."""
    by_id = {i: token for token, i in vocab.items()}
    if sorted(by_id) != list(range(len(vocab))) or tuple(by_id[i] for i in range(4)) != FAIRSEQ_SPECIALS:
        raise UserError(f"{path} is not an FSMT vocabulary (ids 0-{len(vocab) - 1} with {', '.join(FAIRSEQ_SPECIALS)} "
                        "first); pass the folder save_pretrained wrote")
    tokens = [by_id[i] for i in range(4, len(vocab))]
    return [t[: -len("</w>")] if t.endswith("</w>") else t + "@@" for t in tokens]


def _write_dictionary(tokens: list[str], path: Path) -> None:
    # counts only order fairseq's dictionary when it is built; loading keeps the file's order
    write_atomic(path, "".join(f"{token} {len(tokens) - i}\n" for i, token in enumerate(tokens)))


def _fsmt_argv(config: dict, dest: Path, shared: bool) -> list[str]:
    src, tgt = config["langs"]
    activation = config.get("activation_function", "relu")
    if activation not in ACTIVATIONS:
        raise UserError(f"FSMT activation '{activation}' has no fairseq equivalent; hprune imports {', '.join(ACTIVATIONS)}")
    argv = [str(dest), "--task", "translation", "--source-lang", src, "--target-lang", tgt, "--arch", "transformer",
            "--encoder-embed-dim", str(config["d_model"]), "--decoder-embed-dim", str(config["d_model"]),
            "--encoder-ffn-embed-dim", str(config["encoder_ffn_dim"]),
            "--decoder-ffn-embed-dim", str(config["decoder_ffn_dim"]),
            "--encoder-layers", str(config["encoder_layers"]), "--decoder-layers", str(config["decoder_layers"]),
            "--encoder-attention-heads", str(config["encoder_attention_heads"]),
            "--decoder-attention-heads", str(config["decoder_attention_heads"]),
            "--max-source-positions", str(config["max_position_embeddings"]),
            "--max-target-positions", str(config["max_position_embeddings"]),
            "--activation-fn", ACTIVATIONS[activation], "--dropout", str(config.get("dropout", 0.1)),
            "--attention-dropout", str(config.get("attention_dropout", 0.0)),
            "--activation-dropout", str(config.get("activation_dropout", 0.0)),
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]
    if shared:
        argv.append("--share-all-embeddings")
    if not config.get("scale_embedding", True):
        argv.append("--no-scale-embedding")
    return argv


def _import_fsmt(folder: Path, config: dict, staging: Path) -> None:
    from fairseq import options

    for name in ("vocab-src.json", "vocab-tgt.json", "merges.txt"):
        if not (folder / name).is_file():
            raise UserError(f"{folder} has no {name}: an FSMT model's tokenizer files are vocab-src.json, vocab-tgt.json "
                            "and merges.txt (save the tokenizer with save_pretrained into the same folder)")
    src, tgt = config["langs"]
    sides = {src: json.loads((folder / "vocab-src.json").read_text()),
             tgt: json.loads((folder / "vocab-tgt.json").read_text())}
    weights = {key[len("model."):]: tensor for key, tensor in _weights(folder).items() if key.startswith("model.")}
    for lang, key, size_key in ((src, "encoder.embed_tokens.weight", "src_vocab_size"),
                                (tgt, "decoder.embed_tokens.weight", "tgt_vocab_size")):
        rows = weights[key].shape[0] if key in weights else None
        if len(sides[lang]) != rows or rows != config[size_key]:
            raise UserError(f"{folder}: the {lang} vocabulary has {len(sides[lang])} entries but the weights embed {rows} "
                            f"and config.json says {size_key}={config[size_key]}; the files are not one model's")
    for lang, vocab in sides.items():
        _write_dictionary(_fairseq_tokens(vocab, folder / "vocab.json"), staging / f"dict.{lang}.txt")
    merges = [" ".join(line.split()[:2]) for line in (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
              if line.strip() and not line.startswith("#")]
    write_atomic(staging / "bpecodes", "#version: 0.2\n" + "".join(m + "\n" for m in merges))
    tied = bool(config.get("tie_word_embeddings", False))
    shared = tied and sides[src] == sides[tgt]
    if tied and not shared:
        raise UserError(f"{folder}: tied embeddings with two different vocabularies cannot be one fairseq dictionary")
    for side in ("encoder", "decoder"):
        weights.pop(f"{side}.embed_positions.weight", None)  # fairseq computes the same sinusoids
        weights[f"{side}.version"] = torch.tensor([3.0])
    if "decoder.output_projection.weight" not in weights or tied:
        weights["decoder.output_projection.weight"] = weights["decoder.embed_tokens.weight"]
    if shared:
        weights["encoder.embed_tokens.weight"] = weights["decoder.embed_tokens.weight"]
    args = options.parse_args_and_arch(options.get_training_parser(), _fsmt_argv(config, staging, shared))
    state = {"args": args, "model": {k: v.contiguous() for k, v in weights.items()}, "extra_state": {},
             "optimizer_history": [{"criterion_name": "LabelSmoothedCrossEntropyCriterion", "optimizer_name": "FairseqAdam",
                                    "lr_scheduler_state": {}, "num_updates": 0}],
             "last_optimizer_state": None}
    torch.save(state, staging / "model.pt")


def import_hf(folder: Path, models_root: Path) -> Path:
    """The model.pt of a Hugging Face model folder imported as a fairseq model folder under
    `<models_root>/hf/<name>-<fingerprint>/` (imported once; a changed folder is imported again)."""
    folder = Path(folder).expanduser()
    config = _config(folder)
    family = config.get("model_type")
    if family not in FAMILIES:
        raise UserError(f"{folder} holds a Hugging Face '{family}' model; hprune imports translation models of the "
                        f"families {', '.join(FAMILIES)} (FSMTForConditionalGeneration)")
    dest = Path(models_root).expanduser().absolute() / "hf" / f"{folder.name}-{_fingerprint(folder)}"
    if (dest / "model.pt").is_file():
        return dest / "model.pt"
    staging = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _import_fsmt(folder, config, staging)
        write_atomic(staging / "hprune.yaml", f"source: {{hf_dir: {json.dumps(str(folder.absolute()))}, "
                                              f"model_type: {family}}}\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest / "model.pt"
