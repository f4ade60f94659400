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


def build_marian(root: Path, text: dict, size: dict | None = None, vocab_size: int | None = None) -> dict:
    """A Marian en-fr model with OPUS-MT's settings in root/opus-mt-en-fr; text: {lang: training lines}. size: the
    config's dimensions (tiny by default); vocab_size: the vocabulary padded with words the text never meets."""
    import sentencepiece
    model_dir = root / "opus-mt-en-fr"
    model_dir.mkdir()
    pieces = []
    for lang, name in zip(LANGS, ("source", "target")):
        (root / f"{lang}.txt").write_text("".join(line + "\n" for line in text[lang]))
        sentencepiece.SentencePieceTrainer.train(input=str(root / f"{lang}.txt"), model_prefix=str(root / name),
                                                 vocab_size=4000 if size else 120, hard_vocab_limit=False, character_coverage=1.0,
                                                 bos_id=-1, unk_id=0, eos_id=1, pad_id=-1, minloglevel=2)
        shutil.copyfile(root / f"{name}.model", model_dir / f"{name}.spm")
        processor = sentencepiece.SentencePieceProcessor(model_file=str(root / f"{name}.model"))
        pieces += [processor.id_to_piece(i) for i in range(2, processor.get_piece_size())]
    vocab = {"</s>": 0, "<unk>": 1}  # as OPUS-MT's: eos first, <pad> last
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    for i in range((vocab_size or 0) - len(vocab) - 1):
        vocab[f"madeupword{i:06d}"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    (model_dir / "vocab.json").write_text(json.dumps(vocab))
    tokenizer = transformers.MarianTokenizer(str(model_dir / "source.spm"), str(model_dir / "target.spm"),
                                             str(model_dir / "vocab.json"), source_lang="en", target_lang="fr")
    pad = vocab["<pad>"]
    # OPUS-MT's settings: swish, scaled embeddings, all three embeddings tied, <pad> starts the decoder
    dims = size or dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=48, max_position_embeddings=128,
                        activation_function="swish", scale_embedding=True, init_std=0.3)
    config = transformers.MarianConfig(vocab_size=len(vocab), decoder_vocab_size=len(vocab), pad_token_id=pad,
                                       eos_token_id=0, decoder_start_token_id=pad, dropout=0.0, **dims)
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_()  # zero in OPUS-MT's releases: random here, so that it is tested
        model.final_logits_bias[0, 0] += 6.5  # a random model that stops now and then
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return {"dir": model_dir, "model": model, "tokenizer": tokenizer, "root": root, "vocab": vocab, "pad": pad,
            "start": pad, "attention": ("self_attn", "encoder_attn")}


def _joint_sentencepiece(root: Path, text: dict, model_type: str, pieces: int = 150) -> Path:
    """A joint sentencepiece model with the layout these families' models have (<unk> 0, <s> 1, </s> 2)."""
    import sentencepiece
    (root / "joint.txt").write_text("".join(line + "\n" for lang in LANGS for line in text[lang]))
    sentencepiece.SentencePieceTrainer.train(input=str(root / "joint.txt"), model_prefix=str(root / model_type),
                                             vocab_size=pieces, model_type=model_type, hard_vocab_limit=False,
                                             character_coverage=1.0, minloglevel=2)
    return root / f"{model_type}.model"


def _train_a_little(model, tokenizer, text: dict, steps: int = 150) -> None:
    """150 Adam steps on the toy pairs: enough for translations that differ with the source (most test sentences
    translate differently), which those of a random model or one trained less hardly do."""
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    pairs = list(zip(text["en"], text["fr"]))
    for step in range(steps):
        batch = pairs[(step * 32) % len(pairs):][:32]
        inputs = tokenizer([s for s, _ in batch], text_target=[t for _, t in batch], return_tensors="pt", padding=True)
        inputs["labels"][inputs["labels"] == tokenizer.pad_token_id] = -100
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def _multilingual(root: Path, name: str, model, tokenizer, text: dict, languages: tuple[str, str],
                  target_token: str, train: bool = True) -> dict:
    if train:
        _train_a_little(model, tokenizer, text)
    model.generation_config.forced_bos_token_id = None  # set per call, from the target language, as users do
    model_dir = root / name
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return {"dir": model_dir, "model": model, "tokenizer": tokenizer, "root": root, "vocab": None,
            "pad": model.config.pad_token_id, "start": model.config.decoder_start_token_id,
            "attention": ("self_attn", "encoder_attn"), "languages": languages,
            "forced_bos": tokenizer.convert_tokens_to_ids(target_token)}


SMALL = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=64, decoder_ffn_dim=48, max_position_embeddings=128, dropout=0.0, attention_dropout=0.0,
             encoder_layerdrop=0.0, decoder_layerdrop=0.0, init_std=0.05)


def build_m2m100(root: Path, text: dict, size: dict | None = None, vocab_size: int | None = None) -> dict:
    """An M2M100 model as m2m100_418M is laid out: vocab.json (fairseq's dictionary order), sentencepiece.bpe.model,
    the 100 language tokens __xx__ after the vocabulary, 8 made-up words up to vocab_size."""
    spm = _joint_sentencepiece(root, text, "bpe", 4000 if size else 150)
    model_dir = root / "m2m100-tiny"
    model_dir.mkdir()
    shutil.copyfile(spm, model_dir / "sentencepiece.bpe.model")
    import sentencepiece
    processor = sentencepiece.SentencePieceProcessor(model_file=str(spm))
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(3, processor.get_piece_size()):
        vocab.setdefault(processor.id_to_piece(i), len(vocab))
    (model_dir / "vocab.json").write_text(json.dumps(vocab))
    tokenizer = transformers.M2M100Tokenizer(str(model_dir / "vocab.json"), str(model_dir / "sentencepiece.bpe.model"),
                                             src_lang="en", tgt_lang="fr")
    config = transformers.M2M100Config(vocab_size=vocab_size or len(vocab) + 100 + 8, scale_embedding=True, **(size or SMALL))
    torch.manual_seed(0)
    model = transformers.M2M100ForConditionalGeneration(config)
    return _multilingual(root, "m2m100-tiny", model, tokenizer, text, ("en", "fr"), "__fr__", train=size is None)


def build_nllb(root: Path, text: dict, size: dict | None = None, vocab_size: int | None = None) -> dict:
    """An NLLB-200 model (M2M100's architecture, NLLB's tokenizer: sentencepiece BPE ids + 1, 202 language codes
    and <mask> as added tokens, tokenizer.json)."""
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import SentencePieceExtractor
    spm = _joint_sentencepiece(root, text, "bpe", 4000 if size else 150)
    import sentencepiece
    processor = sentencepiece.SentencePieceProcessor(model_file=str(spm))
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({processor.id_to_piece(i): i + 1 for i in range(3, processor.get_piece_size())})
    extracted = SentencePieceExtractor(str(spm)).extract(BPE)
    tokenizer = transformers.NllbTokenizer(vocab=vocab, merges=extracted["merges"], src_lang="eng_Latn",
                                           tgt_lang="fra_Latn",
                                           _spm_precompiled_charsmap=extracted["_spm_precompiled_charsmap"])
    config = transformers.M2M100Config(vocab_size=vocab_size or len(tokenizer) + 2, scale_embedding=True, **(size or SMALL))
    torch.manual_seed(0)
    model = transformers.M2M100ForConditionalGeneration(config)
    built = _multilingual(root, "nllb-200-tiny", model, tokenizer, text, ("eng_Latn", "fra_Latn"), "fra_Latn",
                          train=size is None)
    shutil.copyfile(spm, built["dir"] / "sentencepiece.bpe.model")
    return built


def build_mbart50(root: Path, text: dict, size: dict | None = None, vocab_size: int | None = None) -> dict:
    """An mBART-50 many-to-many model: learned positions, layernorm_embedding, a unigram sentencepiece model
    (ids + 1), the 52 language codes and <mask> after it, the decoder started with </s>."""
    spm = _joint_sentencepiece(root, text, "unigram", 4000 if size else 150)
    folder = root / "mbart50-spm"
    folder.mkdir()
    shutil.copyfile(spm, folder / "sentencepiece.bpe.model")
    tokenizer = transformers.MBart50Tokenizer.from_pretrained(str(folder), src_lang="en_XX", tgt_lang="fr_XX")
    dims = size or {**SMALL, "activation_function": "relu"}
    config = transformers.MBartConfig(vocab_size=vocab_size or len(tokenizer), scale_embedding=True,
                                      decoder_start_token_id=2, forced_eos_token_id=2, **dims)
    torch.manual_seed(0)
    model = transformers.MBartForConditionalGeneration(config)
    built = _multilingual(root, "mbart-large-50-tiny", model, tokenizer, text, ("en_XX", "fr_XX"), "fr_XX",
                          train=size is None)
    shutil.copyfile(spm, built["dir"] / "sentencepiece.bpe.model")
    return built


BUILDERS = {"fsmt": build_fsmt, "marian": build_marian, "m2m100": build_m2m100, "nllb": build_nllb,
            "mbart50": build_mbart50}

if __name__ == "__main__":
    family, out, src, tgt = sys.argv[1:5]
    Path(out).mkdir(parents=True, exist_ok=True)
    lines = {lang: Path(f).read_text(encoding="utf-8").splitlines()[:400] for lang, f in zip(LANGS, (src, tgt))}
    print(BUILDERS[family](Path(out), lines)["dir"])
