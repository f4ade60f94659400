"""Tiny random Hugging Face translation models, built offline from transformers' own config classes (the hubs
cannot be reached): their BPE or sentencepiece models and vocabularies learnt from a few hundred lines of text,
saved with save_pretrained as the hubs' folders are. Used by tests/test_hf.py and scripts/gpu_smoke.sh:

    python tests/hf_models.py marian OUT_DIR TRAIN_TEXT_SRC TRAIN_TEXT_TGT
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers

LANGS = ("en", "fr")


def fsmt_spelling(piece: str) -> str:
    return piece[:-2] if piece.endswith("@@") else piece + "</w>"


def build_fsmt(root: Path, text: dict) -> dict:
    """An FSMT en-fr model in root/fsmt-en-fr; text: {lang: training lines}."""
    from subword_nmt.apply_bpe import BPE
    from subword_nmt.learn_bpe import learn_bpe
    with open(root / "codes", "w") as out:
        learn_bpe(text["en"] + text["fr"], out, 150)
    with open(root / "codes") as f:
        bpe = BPE(f)
    vocab = {}
    for lang in LANGS:
        pieces = sorted({p for line in text[lang] for p in bpe.segment(line).split()})
        vocab[lang] = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>"] + [fsmt_spelling(p) for p in pieces])}
    model_dir = root / "fsmt-en-fr"
    model_dir.mkdir()
    (model_dir / "vocab-src.json").write_text(json.dumps(vocab["en"]))
    (model_dir / "vocab-tgt.json").write_text(json.dumps(vocab["fr"]))
    (model_dir / "merges.txt").write_text("".join(line for line in (root / "codes").read_text().splitlines(True)[1:]))
    tokenizer = transformers.FSMTTokenizer(langs=list(LANGS), src_vocab_file=str(model_dir / "vocab-src.json"),
                                           tgt_vocab_file=str(model_dir / "vocab-tgt.json"),
                                           merges_file=str(model_dir / "merges.txt"))
    config = transformers.FSMTConfig(langs=list(LANGS), src_vocab_size=len(vocab["en"]), tgt_vocab_size=len(vocab["fr"]),
                                     d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=48,
                                     max_position_embeddings=128, init_std=0.3, dropout=0.0)
    torch.manual_seed(0)
    model = transformers.FSMTForConditionalGeneration(config).eval()
    with torch.no_grad():  # a random model that stops now and then (eos logit + 6 on average), as trained ones do
        model.model.decoder.layers[-1].final_layer_norm.bias[0] = 3.0
        model.model.decoder.output_projection.weight[2, 0] += 2.0
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return {"dir": model_dir, "model": model, "tokenizer": tokenizer, "root": root, "vocab": None,
            "pad": config.pad_token_id, "start": config.eos_token_id, "attention": ("self_attn", "encoder_attn")}


def build_marian(root: Path, text: dict) -> dict:
    """A Marian en-fr model with OPUS-MT's settings in root/opus-mt-en-fr; text: {lang: training lines}."""
    import sentencepiece
    model_dir = root / "opus-mt-en-fr"
    model_dir.mkdir()
    pieces = []
    for lang, name in zip(LANGS, ("source", "target")):
        (root / f"{lang}.txt").write_text("".join(line + "\n" for line in text[lang]))
        sentencepiece.SentencePieceTrainer.train(input=str(root / f"{lang}.txt"), model_prefix=str(root / name),
                                                 vocab_size=120, hard_vocab_limit=False, character_coverage=1.0,
                                                 bos_id=-1, unk_id=0, eos_id=1, pad_id=-1, minloglevel=2)
        shutil.copyfile(root / f"{name}.model", model_dir / f"{name}.spm")
        processor = sentencepiece.SentencePieceProcessor(model_file=str(root / f"{name}.model"))
        pieces += [processor.id_to_piece(i) for i in range(2, processor.get_piece_size())]
    vocab = {"</s>": 0, "<unk>": 1}  # as OPUS-MT's: eos first, <pad> last
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    vocab["<pad>"] = len(vocab)
    (model_dir / "vocab.json").write_text(json.dumps(vocab))
    tokenizer = transformers.MarianTokenizer(str(model_dir / "source.spm"), str(model_dir / "target.spm"),
                                             str(model_dir / "vocab.json"), source_lang="en", target_lang="fr")
    pad = vocab["<pad>"]
    # OPUS-MT's settings: swish, scaled embeddings, all three embeddings tied, <pad> starts the decoder
    config = transformers.MarianConfig(vocab_size=len(vocab), decoder_vocab_size=len(vocab), d_model=32, encoder_layers=2,
                                       decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                       encoder_ffn_dim=64, decoder_ffn_dim=48, max_position_embeddings=128,
                                       activation_function="swish", scale_embedding=True, pad_token_id=pad,
                                       eos_token_id=0, decoder_start_token_id=pad, init_std=0.3, dropout=0.0)
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_()  # zero in OPUS-MT's releases: random here, so that it is tested
        model.final_logits_bias[0, 0] += 6.5  # a random model that stops now and then
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return {"dir": model_dir, "model": model, "tokenizer": tokenizer, "root": root, "vocab": vocab, "pad": pad,
            "start": pad, "attention": ("self_attn", "encoder_attn")}


BUILDERS = {"fsmt": build_fsmt, "marian": build_marian}

if __name__ == "__main__":
    family, out, src, tgt = sys.argv[1:5]
    Path(out).mkdir(parents=True, exist_ok=True)
    lines = {lang: Path(f).read_text(encoding="utf-8").splitlines()[:400] for lang, f in zip(LANGS, (src, tgt))}
    print(BUILDERS[family](Path(out), lines)["dir"])
