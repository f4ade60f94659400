"""Hugging Face translation models imported as fairseq model folders (model.pt, dict.<lang>.txt, bpecodes), which
every verb then takes as it takes a published fairseq model (data=pretrained).

FSMT (`FSMTForConditionalGeneration`, fairseq's WMT19 models as transformers ships them) is fairseq's
Transformer with `model.` before every key and rewritten vocabularies; both are turned back:
  - weights: `model.<fairseq key>` -> `<fairseq key>`; the sinusoidal position tables are recomputed by fairseq
  - vocabularies (vocab-src.json, vocab-tgt.json): ids 0-3 are fairseq's specials, a word-final piece `ab</w>`
    is fairseq's `ab`, any other piece `ab` is fairseq's `ab@@`; ids are kept, so no weight row moves
  - merges.txt: subword-nmt (version 0.2) codes, the same merge rule FSMT's tokenizer applies

M2M100, NLLB-200 and mBART-50 (`M2M100ForConditionalGeneration`, `MBartForConditionalGeneration`) are fairseq's
pre-norm Transformer with every embedding shared, converted from fairseq without reordering a row:
  - weights: `model.<fairseq key>` -> `<fairseq key>`, `lm_head` -> the output projection; M2M100's sinusoidal
    positions are recomputed by fairseq (the same table, offset 2), mBART's learned ones (offset 2) and its
    layernorm_embedding are kept as they are
  - the vocabulary: one dictionary, dict.txt, in the model's id order (tokenizer.json, or M2M100's vocab.json
    followed by its language tokens), made-up words up to vocab_size as fairseq pads a dictionary; the
    sentencepiece model that segments the text for it
  - languages: multilingual, so the pair is chosen at use (data.src_lang, data.tgt_lang); hprune.yaml lists the
    codes and the tokens that mark them: the source starts with its language's token and the decoder is made
    to emit the target language's first (a forced first token), as these tokenizers and `generate` do

Weights are read with safetensors (no pickle) or, for an older `pytorch_model.bin`, with torch's weights-only
unpickler; transformers itself is not needed to import.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Optional

import torch

from ..errors import UserError
from ..files import build_once, write_atomic
from ..hub import snapshot_repo
from ..model_folder import HF_FAMILIES, HF_WEIGHTS, hf_family, read_hf_config, write_settings
from .compat import PLUGIN_DIR

FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
FSMT_FILES, MARIAN_FILES = HF_FAMILIES["fsmt"].files, HF_FAMILIES["marian"].files
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_accurate", "swish": "relu", "silu": "relu",
               "tanh": "tanh"}  # swish: set after parsing (_save)
NO_LOGIT = -100.0  # output bias of a fairseq special Marian lacks: exp(-100) adds nothing to the softmax, and the
#                    label-smoothing term stays finite when the model is fine-tuned
INSTALL = "pip install 'hprune[hf]'"


def _weights(folder: Path) -> dict:
    """The folder's weights, or one line saying which file cannot be read (a download cut short, a full disk)."""
    path = next((folder / name for name in HF_WEIGHTS if (folder / name).is_file()), None)
    if path is None:
        raise UserError(f"{folder} has no model.safetensors or pytorch_model.bin; pass the folder save_pretrained "
                        "wrote")
    if path.name == "model.safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise UserError(f"{folder} holds safetensors weights, which need the safetensors package: "
                            f"{INSTALL}") from None
        read = lambda: load_file(str(path))  # noqa: E731
    else:
        read = lambda: torch.load(path, map_location="cpu", weights_only=True)  # noqa: E731
    try:
        weights = read()
    except Exception as err:  # noqa: BLE001 - safetensors' SafetensorError, torch's RuntimeError, EOFError, ...
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0].split(". ")[0]
        if "Weights only load failed" in reason:
            raise UserError(f"{path} holds objects other than tensors, which hprune does not unpickle; save the model "
                            "again with save_pretrained (it writes model.safetensors)") from None
        raise UserError(f"{path} cannot be read ({reason[:160]}): it is truncated or damaged; download it again, or "
                        "save the model again with save_pretrained") from None
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise UserError(f"{path} is not a state dict of tensors; pass the folder save_pretrained wrote")
    return weights


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not JSON ({str(err)[:120]}): it is truncated or damaged; download it again, or "
                        "save the tokenizer again with save_pretrained") from None


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


def _argv(config: dict, langs: Optional[tuple[str, str]], dest: Path, flags: list[str]) -> list[str]:
    """fairseq's command line for a BART-style config (FSMT, Marian, M2M100, mBART share the key names); langs:
    None for a multilingual model (the pair is chosen at use)."""
    activation = config.get("activation_function", "relu")
    if activation not in ACTIVATIONS:
        raise UserError(f"activation '{activation}' has no fairseq equivalent; hprune imports {', '.join(ACTIVATIONS)}")
    argv = [str(dest), "--task", "translation",
            *(["--source-lang", langs[0], "--target-lang", langs[1]] if langs else []),
            "--arch", "hprune_transformer", "--user-dir", PLUGIN_DIR,
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
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", *flags]
    if not config.get("scale_embedding", True):
        argv.append("--no-scale-embedding")
    return argv


def _save(config: dict, langs: Optional[tuple[str, str]], weights: dict, staging: Path, flags: list[str]) -> None:
    """model.pt in the legacy `args` layout fairseq's loaders and hprune's read alike."""
    from fairseq import options

    for side in ("encoder", "decoder"):
        weights[f"{side}.version"] = torch.tensor([3.0])
    args = options.parse_args_and_arch(options.get_training_parser(), _argv(config, langs, staging, flags))
    if config.get("activation_function") in ("swish", "silu"):
        args.activation_fn = "swish"  # fairseq computes it but its command line does not offer it (see _swish)
    weights = {k: v.contiguous() for k, v in weights.items()}
    _check_weights_fit(args, weights, staging)
    state = {"args": args, "model": weights, "extra_state": {},
             "optimizer_history": [{"criterion_name": "LabelSmoothedCrossEntropyCriterion", "optimizer_name": "FairseqAdam",
                                    "lr_scheduler_state": {}, "num_updates": 0}],
             "last_optimizer_state": None}
    torch.save(state, staging / "model.pt")


class WeightsMismatch(Exception):
    """config.json describes another model than the weights hold (import_hf names the folder)."""


def _check_weights_fit(args, weights: dict, staging: Path) -> None:
    """The model config.json describes takes these weights, every one and nothing else, as loading will (built
    on the meta device: no memory for a copy): else the import stops here, in one line, and leaves nothing."""
    from types import SimpleNamespace

    from fairseq.data import Dictionary
    from fairseq.models import ARCH_MODEL_REGISTRY

    def dictionary(lang: Optional[str]) -> Dictionary:
        return Dictionary.load(str(staging / (f"dict.{lang}.txt" if lang else "dict.txt")))

    task = SimpleNamespace(source_dictionary=dictionary(getattr(args, "source_lang", None)),
                           target_dictionary=dictionary(getattr(args, "target_lang", None)))
    with torch.device("meta"):
        model = ARCH_MODEL_REGISTRY[args.arch].build_model(args, task)
    try:
        with warnings.catch_warnings():  # loading into meta parameters copies nothing: that is the point
            warnings.filterwarnings("ignore", message=".*to a meta parameter")
            model.load_state_dict(dict(weights), strict=True)
    except RuntimeError as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 else lines[0] if lines else type(err).__name__
        raise WeightsMismatch(detail[:300]) from None


def _require(folder: Path, names: tuple[str, ...], what: str) -> None:
    for name in names:
        if not (folder / name).is_file():
            raise UserError(f"{folder} has no {name}: {what} (save the tokenizer with save_pretrained into the "
                            "same folder)")


def _import_fsmt(folder: Path, config: dict, staging: Path) -> dict:
    _require(folder, FSMT_FILES, f"an FSMT model's tokenizer files are {', '.join(FSMT_FILES)}")
    src, tgt = config["langs"]
    sides = {src: _json(folder / "vocab-src.json"), tgt: _json(folder / "vocab-tgt.json")}
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
    if "decoder.output_projection.weight" not in weights or tied:
        weights["decoder.output_projection.weight"] = weights["decoder.embed_tokens.weight"]
    if shared:
        weights["encoder.embed_tokens.weight"] = weights["decoder.embed_tokens.weight"]
    _save(config, (src, tgt), weights, staging, ["--share-all-embeddings"] if shared else [])
    return {}


def _marian_languages(folder: Path, tokenizer: dict) -> tuple[str, str]:
    langs = (tokenizer.get("source_lang"), tokenizer.get("target_lang"))
    if not all(langs):
        named = re.fullmatch(r"(?:.*[-_])?opus-mt-([a-z]{2,3})-([a-z]{2,3})", folder.name.lower())
        langs = named.groups() if named else langs
    if not all(langs) or any("." in lang for lang in langs):
        raise UserError(f"{folder}: cannot tell the languages (tokenizer_config.json has no source_lang/target_lang "
                        "and the folder is not named opus-mt-SRC-TGT); add \"source_lang\" and \"target_lang\" to "
                        "tokenizer_config.json")
    return langs


def _import_marian(folder: Path, config: dict, staging: Path) -> dict:
    """Marian ids -> fairseq ids: fairseq's <s>, <pad>, </s>, <unk> (ids 0-3) are Marian's <s> if it has one
    (else a new zero row, never predicted), <pad>, </s> and <unk>; Marian's other pieces follow in id order."""
    _require(folder, MARIAN_FILES, f"a Marian model's tokenizer files are {', '.join(MARIAN_FILES)}")
    tokenizer = _tokenizer_config(folder)
    separate = bool(tokenizer.get("separate_vocabs")) or not config.get("share_encoder_decoder_embeddings", True)
    if separate:
        _require(folder, ("target_vocab.json",), "a Marian model with separate vocabularies has target_vocab.json")
    src, tgt = _marian_languages(folder, tokenizer)
    vocabs = {src: _json(folder / "vocab.json")}
    vocabs[tgt] = _json(folder / "target_vocab.json") if separate else vocabs[src]
    weights = {key[len("model."):] if key.startswith("model.") else key: tensor
               for key, tensor in _weights(folder).items()}
    shared = weights.get("shared.weight")
    embeddings = {src: weights.get("encoder.embed_tokens.weight", shared),
                  tgt: weights.get("decoder.embed_tokens.weight", shared)}
    sizes = {src: config["vocab_size"], tgt: config.get("decoder_vocab_size") or config["vocab_size"]}
    pad, eos, start = config["pad_token_id"], config["eos_token_id"], config["decoder_start_token_id"]
    orders = {}
    for lang in (src, tgt):
        vocab, rows = vocabs[lang], embeddings[lang].shape[0] if embeddings[lang] is not None else None
        if len(vocab) != rows or rows != sizes[lang] or sorted(vocab.values()) != list(range(len(vocab))):
            raise UserError(f"{folder}: the {lang} vocabulary has {len(vocab)} entries but the weights embed {rows} "
                            f"and config.json says {sizes[lang]}; the files are not one model's")
        if "<unk>" not in vocab:
            raise UserError(f"{folder}: the {lang} vocabulary has no <unk>; pass the folder save_pretrained wrote")
        specials = [vocab.get("<s>"), pad, eos, vocab["<unk>"]]
        orders[lang] = specials + [i for i in range(len(vocab)) if i not in specials]
        by_id = {i: token for token, i in vocab.items()}
        _write_dictionary([by_id[i] for i in orders[lang][4:]], staging / f"dict.{lang}.txt")

    def fairseq_rows(matrix: torch.Tensor, lang: str, missing: float = 0.0) -> torch.Tensor:
        order = orders[lang]
        rows = matrix[[i if i is not None else 0 for i in order]].clone()
        if order[0] is None:
            rows[0] = missing
        return rows

    tied = config.get("tie_word_embeddings", True)
    out = {key: tensor for key, tensor in weights.items() if key.startswith(("encoder.layers.", "decoder.layers."))}
    out["encoder.embed_tokens.weight"] = fairseq_rows(embeddings[src], src)
    out["decoder.embed_tokens.weight"] = fairseq_rows(embeddings[tgt], tgt)
    out["decoder.embed_tokens.start"] = embeddings[tgt][start].clone()
    head = embeddings[tgt] if tied else weights["lm_head.weight"]
    out["decoder.output_projection.weight"] = out["decoder.embed_tokens.weight"] if tied else fairseq_rows(head, tgt)
    bias = weights.get("final_logits_bias", torch.zeros(1, sizes[tgt])).reshape(-1)
    out["decoder.output_projection.bias"] = fairseq_rows(bias, tgt, missing=NO_LOGIT)
    flags = ["--marian-positions", "--decoder-start-embedding", "--output-bias"]
    if tied and not separate and shared is not None:
        flags.append("--share-all-embeddings")
        out["encoder.embed_tokens.weight"] = out["decoder.embed_tokens.weight"]
    elif tied:
        flags.append("--share-decoder-input-output-embed")
    for lang, name in ((src, "source.spm"), (tgt, "target.spm")):
        _check_sentencepiece(folder / name)
        shutil.copyfile(folder / name, staging / f"spm.{lang}.model")
    _save(config, (src, tgt), out, staging, flags)
    return {"tokenizer": "none"}  # Marian's tokenizer puts raw text into sentencepiece


# M2M100's language codes, in the order its tokenizer appends their tokens __xx__ after vocab.json (a folder's
# tokenizer_config.json names the list: language_codes); NLLB's and mBART-50's are in their tokenizer.json
M2M100_LANGUAGES = {
    "m2m100": "af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu ha he hi "
              "hr ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr ms my ne nl no ns "
              "oc or pa pl ps pt ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk ur uz vi wo xh yi yo zh zu",
    "wmt21": "en ha is ja cs ru zh de"}
# mBART-50's, in the order MBart50Tokenizer appends them after the sentencepiece pieces (then <mask>), for a
# folder without tokenizer.json
MBART50_LANGUAGES = ("ar_AR cs_CZ de_DE en_XX es_XX et_EE fi_FI fr_XX gu_IN hi_IN it_IT ja_XX kk_KZ ko_KR lt_LT lv_LV "
                     "my_MM ne_NP nl_XX ro_RO ru_RU si_LK tr_TR vi_VN zh_CN af_ZA az_AZ bn_IN fa_IR he_IL hr_HR id_ID "
                     "ka_GE km_KH mk_MK ml_IN mn_MN mr_IN pl_PL ps_AF pt_XX sv_SE sw_KE ta_IN te_IN th_TH tl_XX uk_UA "
                     "ur_PK xh_ZA gl_ES sl_SI")
NOT_LANGUAGES = {"<mask>"}


def _tokenizer_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    return _json(path) if path.is_file() else {}


def _tokenizer_json_ids(path: Path) -> tuple[dict[int, str], list[str]]:
    """A tokenizer.json's {id: token}, and its added tokens."""
    tokenizer = _json(path)
    if not isinstance(tokenizer.get("model"), dict) or "vocab" not in tokenizer["model"]:
        raise UserError(f"{path} has no model vocabulary; pass the folder save_pretrained wrote")
    vocab, added = tokenizer["model"]["vocab"], tokenizer.get("added_tokens", [])
    ids = dict(enumerate(piece for piece, _ in vocab)) if isinstance(vocab, list) else \
        {i: token for token, i in vocab.items()}
    ids.update({token["id"]: token["content"] for token in added})
    return ids, [token["content"] for token in added]


SENTENCEPIECE = "sentencepiece.bpe.model"  # M2M100's, NLLB's and mBART-50's segmentation model
COPY_SENTENCEPIECE = "copy sentencepiece.bpe.model from the model's Hub repository into the folder"


def _check_sentencepiece(path: Path):
    """The sentencepiece model at `path`, loaded (it is what segments the text later), or one line."""
    import sentencepiece

    if not path.is_file():
        raise UserError(f"{path.parent} has no {path.name}, the sentencepiece model that segments the text for it; "
                        "save the tokenizer with save_pretrained into the same folder")
    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(path))
    except Exception as err:  # noqa: BLE001 - sentencepiece's RuntimeError / OSError on a damaged file
        raise UserError(f"{path} is not a sentencepiece model ({str(err).strip()[:120]}): it is truncated or "
                        "damaged; download it again") from None


def _sentencepiece_model(folder: Path, dest: Path) -> None:
    """The sentencepiece model of a multilingual folder, to `dest`: the folder's own, else made from its
    tokenizer.json (transformers 5 saves NLLB's and mBART-50's tokenizers as tokenizer.json alone)."""
    if (folder / SENTENCEPIECE).is_file() or not (folder / "tokenizer.json").is_file():
        _check_sentencepiece(folder / SENTENCEPIECE)
        shutil.copyfile(folder / SENTENCEPIECE, dest)
        return
    dest.write_bytes(_sentencepiece_from_tokenizer_json(folder / "tokenizer.json"))
    _check_same_segmentation(folder / "tokenizer.json", dest)


def _sentencepiece_from_tokenizer_json(path: Path) -> bytes:
    """A sentencepiece model (its protobuf) that segments as a tokenizer.json converted from one does: a
    sentencepiece-style tokenizer (Metaspace pieces; a Unigram model with its scores, or a BPE model whose merges
    become the scores that order them, as sentencepiece's BPE merges the best-scored pair first), with its
    normalizer's precompiled character map. Anything else is one line (no sentencepiece model can say it)."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as spm_pb2
    except ImportError:
        raise UserError(f"{path.parent} has no {SENTENCEPIECE}; making one from tokenizer.json needs protobuf: "
                        f"pip install protobuf, or {COPY_SENTENCEPIECE}") from None
    tokenizer = _json(path)
    model = tokenizer.get("model") or {}
    unsupported = f"{path.parent} has no {SENTENCEPIECE}, and its tokenizer.json is not a sentencepiece-style one"

    def steps(node, key):  # a component, or the members of its Sequence
        return [] if not node else node.get(key, []) if node.get("type") == "Sequence" else [node]

    pre = [step.get("type") for step in steps(tokenizer.get("pre_tokenizer"), "pretokenizers")]
    metaspace = next((step for step in steps(tokenizer.get("pre_tokenizer"), "pretokenizers")
                      if step.get("type") == "Metaspace"), None)
    if pre not in (["Metaspace"], ["WhitespaceSplit", "Metaspace"]) or metaspace.get("replacement") != "\u2581" or \
            metaspace.get("prepend_scheme", "always" if metaspace.get("add_prefix_space", True) else "never") != "always":
        raise UserError(f"{unsupported} (its pre-tokenizer is {pre or 'none'}, not sentencepiece's Metaspace); "
                        f"{COPY_SENTENCEPIECE}")
    charsmap, collapse = b"", False
    for step in steps(tokenizer.get("normalizer"), "normalizers"):
        if step.get("type") == "Precompiled":
            import base64
            charsmap = base64.b64decode(step.get("precompiled_charsmap") or "")
        elif step.get("type") == "Replace" and step.get("pattern") == {"Regex": " {2,}"} and step.get("content") == " ":
            collapse = True
        else:
            raise UserError(f"{unsupported} (its normalizer has a {step.get('type')} step); {COPY_SENTENCEPIECE}")
    added = {token["content"] for token in tokenizer.get("added_tokens", [])}
    proto = spm_pb2.ModelProto()
    proto.normalizer_spec.name = "nmt_nfkc" if charsmap else "identity"
    proto.normalizer_spec.precompiled_charsmap = charsmap
    proto.normalizer_spec.add_dummy_prefix = True
    proto.normalizer_spec.remove_extra_whitespaces = collapse
    proto.normalizer_spec.escape_whitespaces = True
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 0, 1, 2
    proto.trainer_spec.pad_id = -1
    proto.trainer_spec.byte_fallback = bool(model.get("byte_fallback", False))
    if model.get("type") == "Unigram":
        proto.trainer_spec.model_type = spm_pb2.TrainerSpec.UNIGRAM
        scored = [(piece, score) for piece, score in model["vocab"]]
    elif model.get("type") == "BPE" and isinstance(model.get("vocab"), dict):
        proto.trainer_spec.model_type = spm_pb2.TrainerSpec.BPE
        rank: dict[str, int] = {}
        for i, merge in enumerate(model.get("merges", [])):
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            rank.setdefault(left + right, i)
        by_id = sorted(model["vocab"].items(), key=lambda item: item[1])
        scored = [(piece, -float(rank.get(piece, len(rank) + i))) for i, (piece, _) in enumerate(by_id)]
    else:
        raise UserError(f"{unsupported} (its model is {model.get('type')}, not Unigram or BPE); {COPY_SENTENCEPIECE}")
    specials = (("<unk>", spm_pb2.ModelProto.SentencePiece.UNKNOWN), ("<s>", spm_pb2.ModelProto.SentencePiece.CONTROL),
                ("</s>", spm_pb2.ModelProto.SentencePiece.CONTROL))
    for piece, kind in specials:
        proto.pieces.add(piece=piece, score=0.0, type=kind)
    skip = added | set(FAIRSEQ_SPECIALS)
    for piece, score in scored:
        if piece not in skip:
            proto.pieces.add(piece=piece, score=score, type=spm_pb2.ModelProto.SentencePiece.NORMAL)
    proto.trainer_spec.vocab_size = len(proto.pieces)
    return proto.SerializeToString()


def _check_same_segmentation(tokenizer_json: Path, spm_model: Path) -> None:
    """The sentencepiece model made from tokenizer.json segments as the tokenizer itself (the `tokenizers`
    library) does, on text made of every piece of the vocabulary, in order and shuffled: else one line."""
    import random

    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError(f"{tokenizer_json.parent} has no {SENTENCEPIECE}; making one from tokenizer.json needs the "
                        f"tokenizers package: {INSTALL}, or {COPY_SENTENCEPIECE}") from None
    definition = _json(tokenizer_json)
    definition.update(added_tokens=[], post_processor=None, padding=None, truncation=None)  # the segmentation alone
    theirs = Tokenizer.from_str(json.dumps(definition))
    ours = _check_sentencepiece(spm_model)
    pieces = [ours.id_to_piece(i) for i in range(3, ours.get_piece_size())]
    shuffled = pieces[:]
    random.Random(0).shuffle(shuffled)
    lines = ["".join(order[i:i + 24]).replace("\u2581", " ").strip()  # pieces without ▁ continue a word
             for order in (pieces, shuffled) for i in range(0, len(order), 24)]
    lines = [line for line in lines if line]
    expected = [encoding.tokens for encoding in theirs.encode_batch(lines, add_special_tokens=False)]
    got = [[ours.id_to_piece(i) for i in ids] for ids in ours.encode(lines)]
    differ = [i for i, (a, b) in enumerate(zip(expected, got)) if a != b]
    if differ:
        raise UserError(f"{tokenizer_json.parent} has no {SENTENCEPIECE}, and the one hprune made from tokenizer.json "
                        f"segments {len(differ)} of {len(lines)} test lines otherwise (e.g. {lines[differ[0]][:60]!r}); "
                        f"{COPY_SENTENCEPIECE}")


def _multilingual_vocabulary(folder: Path, config: dict) -> tuple[list[str], dict[str, str]]:
    """The model's tokens in id order, padded to vocab_size, and its languages {code: token}."""
    settings = _tokenizer_config(folder)
    languages: dict[str, str] = {}
    if (folder / "tokenizer.json").is_file():  # NLLB, mBART-50: the languages are the added tokens past the specials
        ids, added = _tokenizer_json_ids(folder / "tokenizer.json")
        languages = {token: token for token in added if token not in FAIRSEQ_SPECIALS and token not in NOT_LANGUAGES}
    elif config.get("model_type") == "mbart":
        # mBART-50 without tokenizer.json: fairseq's ids (the pieces + 1), then its language codes, then <mask>
        pieces = _check_sentencepiece(folder / SENTENCEPIECE)
        ids = dict(enumerate(FAIRSEQ_SPECIALS))
        ids.update({i + 1: pieces.id_to_piece(i) for i in range(3, pieces.get_piece_size())})
        for code in MBART50_LANGUAGES.split():
            ids[len(ids)] = languages[code] = code
        ids[len(ids)] = "<mask>"
    elif (folder / "vocab.json").is_file():  # M2M100: vocab.json, then its language tokens
        vocab = _json(folder / "vocab.json")
        ids = {i: token for token, i in vocab.items()}
        codes = M2M100_LANGUAGES.get(settings.get("language_codes", "m2m100"))
        if codes is None:
            raise UserError(f"{folder}/tokenizer_config.json: language_codes={settings['language_codes']!r} is not "
                            f"one M2M100's tokenizer knows ({', '.join(M2M100_LANGUAGES)})")
        for i, code in enumerate(codes.split()):
            ids[len(vocab) + i] = languages[code] = f"__{code}__"
    else:
        raise UserError(f"{folder} has neither tokenizer.json nor vocab.json: an M2M100 / NLLB model's ids are in one "
                        "of them (save the tokenizer with save_pretrained into the same folder)")
    size = config["vocab_size"]
    if sorted(ids) != list(range(len(ids))) or tuple(ids.get(i) for i in range(4)) != FAIRSEQ_SPECIALS:
        raise UserError(f"{folder}: the tokenizer's ids are not fairseq's ({', '.join(FAIRSEQ_SPECIALS)} first, then "
                        "every id once); pass the folder save_pretrained wrote")
    if len(ids) > size:
        raise UserError(f"{folder}: the tokenizer has {len(ids)} tokens but config.json says vocab_size={size}; the "
                        "files are not one model's")
    tokens = [ids[i] for i in range(len(ids))] + [f"madeupword{i:04d}" for i in range(size - len(ids))]
    if len(set(tokens)) != len(tokens):
        raise UserError(f"{folder}: the tokenizer maps two ids to one token; pass the folder save_pretrained wrote")
    if not languages:
        raise UserError(f"{folder}: the tokenizer names no language tokens; pass the folder save_pretrained wrote")
    return tokens, languages


def _import_multilingual(folder: Path, config: dict, staging: Path, learned_positions: bool) -> dict:
    tokens, languages = _multilingual_vocabulary(folder, config)
    weights = {key.removeprefix("model."): tensor for key, tensor in _weights(folder).items()}
    shared = weights.pop("shared.weight", None)
    for side in ("encoder", "decoder"):
        weights.setdefault(f"{side}.embed_tokens.weight", shared)
        if not learned_positions:
            weights.pop(f"{side}.embed_positions.weights", None)  # older files keep the sinusoids fairseq recomputes
            weights.pop(f"{side}.embed_positions.weight", None)
    embeddings = weights["decoder.embed_tokens.weight"]
    if embeddings is None or embeddings.shape[0] != len(tokens):
        rows = None if embeddings is None else embeddings.shape[0]
        raise UserError(f"{folder}: the weights embed {rows} tokens but config.json says vocab_size={len(tokens)}; "
                        "the files are not one model's")
    weights["encoder.embed_tokens.weight"] = weights["decoder.embed_tokens.weight"]
    head = weights.pop("lm_head.weight", None)
    weights["decoder.output_projection.weight"] = embeddings if head is None or config.get("tie_word_embeddings", True) \
        else head
    flags = ["--share-all-embeddings", "--encoder-normalize-before", "--decoder-normalize-before"]
    bias = weights.pop("final_logits_bias", None)
    if bias is not None and bias.abs().max() > 0:  # zero in the published models
        weights["decoder.output_projection.bias"] = bias.reshape(-1)
        flags.append("--output-bias")
    if learned_positions:
        flags += ["--encoder-learned-pos", "--decoder-learned-pos", "--layernorm-embedding"]
    _write_dictionary(tokens[4:], staging / "dict.txt")
    _sentencepiece_model(folder, staging / SENTENCEPIECE)
    _save(config, None, weights, staging, flags)
    # the text as the tokenizer takes it: raw into sentencepiece (its own normalisation)
    return {"tokenizer": "none", "languages": dict(sorted(languages.items()))}


def _import_m2m_100(folder: Path, config: dict, staging: Path) -> dict:
    return _import_multilingual(folder, config, staging, learned_positions=False)


def _import_mbart(folder: Path, config: dict, staging: Path) -> dict:
    settings = _tokenizer_config(folder)
    if settings.get("tokenizer_class", "MBart50Tokenizer").removesuffix("Fast") != "MBart50Tokenizer":
        raise UserError(f"{folder} holds an mBART model with {settings['tokenizer_class']} (mBART-25 puts the language "
                        "after the sentence and starts the decoder with it); hprune imports mBART-50's layout "
                        "(MBart50Tokenizer)")
    if config.get("decoder_start_token_id", 2) != 2:
        raise UserError(f"{folder}: config.json starts the decoder with id {config['decoder_start_token_id']}; "
                        "mBART-50 and hprune start it with </s> (id 2)")
    return _import_multilingual(folder, config, staging, learned_positions=True)


# each family's importer, (folder, config, staging) -> hprune.yaml settings, attached to its entry in
# model_folder.HF_FAMILIES (which lies below torch)
for _model_type, _importer in {"fsmt": _import_fsmt, "marian": _import_marian, "m2m_100": _import_m2m_100,
                               "mbart": _import_mbart}.items():
    HF_FAMILIES.attach(_model_type, importer=_importer)


def import_hf(folder: Path, models_root: Path) -> Path:
    """The model.pt of a Hugging Face model folder imported as a fairseq model folder under
    `<models_root>/hf/<name>-<fingerprint>/` (imported once; a changed folder is imported again). The import is
    built in a staging folder and renamed into place once the model it describes has taken its weights: a
    failed or interrupted import leaves nothing (files.build_once)."""
    folder = Path(folder).expanduser()
    config = read_hf_config(folder)
    family = hf_family(config, folder)
    repo = snapshot_repo(folder)  # a Hub snapshot is named after its repository
    name = repo.replace("/", "--") if repo else folder.name
    dest = Path(models_root).expanduser().absolute() / "hf" / f"{name}-{_fingerprint(folder)}"

    def convert(staging: Path) -> None:
        try:
            settings = HF_FAMILIES[family].importer(folder, config, staging)
        except WeightsMismatch as err:
            raise UserError(f"{folder}: config.json does not match the weights ({err}); the files are not one "
                            "model's: pass the folder save_pretrained wrote") from None
        except KeyError as err:  # a key every such model's config.json and weights have
            raise UserError(f"{folder}: {err} is missing from config.json or the weights; pass the folder "
                            "save_pretrained wrote") from None
        write_settings(staging, {"source": {"hf_dir": str(folder.absolute()), "model_type": family}, **settings})

    build_once(dest, "model.pt", convert)
    return dest / "model.pt"
