"""The sizes users meet: the real configurations of facebook/nllb-200-distilled-600M and facebook/m2m100_418M
(12 + 12 layers, d = 1024, 16 heads, FFN 4096; vocabularies of 256,206 and 128,112), built by transformers with
random weights (no download: speed does not depend on them) and saved with save_pretrained beside a tokenizer of
the real size and layout. Measured: `hprune`'s import (wall time and the importing process's peak memory, each
in a process of its own), and the CTranslate2 int8 speed-up of every layer keeping 8 of its 16 heads (per stack,
as CTranslate2 holds them), 16 sentences of 20 source tokens, beam 4, every hypothesis forced to 30 tokens, from
the target language token; pruned and unpruned alternate, 2 rounds, medians; 1 and 2 threads.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODELS = {  # as their config.json on the Hub (docs/your-model.md)
    "nllb-200-distilled-600M": {"vocab_size": 256206, "tokens": 256001, "languages": "nllb"},
    "m2m100_418M": {"vocab_size": 128112, "tokens": 128004, "languages": "m2m100"},
}
SENTENCES, SOURCE_TOKENS, LENGTH, BEAM, ROUNDS = 16, 20, 30, 4, 2


def tokenizer_files(folder: Path, name: str, spec: dict) -> str:
    """A tokenizer of the real size and layout (the pieces' spellings do not matter here); the target token."""
    import sentencepiece
    text = folder / "text.txt"
    text.write_text("a b c d e f g h\n" * 50)
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(folder / "sentencepiece.bpe"),
                                             vocab_size=12, hard_vocab_limit=False, minloglevel=2)
    text.unlink()
    (folder / "sentencepiece.bpe.vocab").unlink()
    pieces = ["<s>", "<pad>", "</s>", "<unk>"] + [f"p{i}" for i in range(spec["tokens"] - 4)]
    if spec["languages"] == "m2m100":
        (folder / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}))
        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "M2M100Tokenizer",
                                                                  "language_codes": "m2m100"}))
        return "__fr__"
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES
    added = [{"id": i, "content": p} for i, p in enumerate(pieces[:4])]
    added += [{"id": len(pieces) + i, "content": code} for i, code in enumerate(FAIRSEQ_LANGUAGE_CODES + ["<mask>"])]
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {p: i for i, p in enumerate(pieces)}},
                                                       "added_tokens": added}))
    return "fra_Latn"


def build(folder: Path, name: str, spec: dict) -> str:
    import transformers
    config = transformers.M2M100Config(vocab_size=spec["vocab_size"], scale_embedding=True)  # the class defaults:
    torch.manual_seed(0)                                                                    # m2m100_418M's
    transformers.M2M100ForConditionalGeneration(config).save_pretrained(folder)
    return tokenizer_files(folder, name, spec)


# the peak is this process's VmHWM: getrusage's ru_maxrss would carry over the forking parent's (Linux keeps it
# across execve), and the parent holds a whole model by then
IMPORT = """
import re, sys, time
from pathlib import Path
from hprune.backend import import_hf
started = time.perf_counter()
import_hf(Path(sys.argv[1]), Path(sys.argv[2]))
peak = re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)
print(time.perf_counter() - started, peak)
"""


def main() -> None:
    import ctranslate2

    from hprune import backend
    from hprune.deploy import ctranslate2 as writer
    from hprune.pruning.heads import layout

    print(f"  {'model':<26} {'parameters':>11} {'import':>8} {'peak memory':>12}  {'threads':>7} {'unpruned':>9} "
          f"{'8 of 16 heads':>14} {'speed-up':>9}   (CTranslate2 int8, sentences/s, beam {BEAM}, {SENTENCES} x "
          f"{LENGTH} tokens)")
    for name, spec in MODELS.items():
        with tempfile.TemporaryDirectory() as tmp:
            hf, models = Path(tmp) / name, Path(tmp) / "models"
            hf.mkdir()
            target = build(hf, name, spec)
            proc = subprocess.run([sys.executable, "-c", IMPORT, str(hf), str(models)], capture_output=True, text=True,
                                  env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if proc.returncode != 0:
                sys.exit(proc.stderr[-3000:])
            seconds, peak_kb = (float(x) for x in proc.stdout.split()[-2:])
            ckpt = next(models.glob("hf/*/model.pt"))
            data = Path(tmp) / "dicts"
            data.mkdir()
            for lang in ("src", "tgt"):
                (data / f"dict.{lang}.txt").write_bytes((ckpt.parent / "dict.txt").read_bytes())
            full = backend.load_model(ckpt, data, languages=("src", "tgt"))
            parameters = sum(p.numel() for p in full.model.parameters())
            kept = {kind: [list(range(n // 2)) for n in per_layer] for kind, per_layer in layout(full.model).items()}
            every = {kind: [list(range(n)) for n in per_layer] for kind, per_layer in layout(full.model).items()}
            dirs = {}
            for label, heads in (("unpruned", every), ("half", kept)):
                dirs[label] = Path(tmp) / label
                dirs[label].mkdir()
                model = backend.pruned_model(full, heads)
                writer.save(writer.model_spec(model, full.cfg.model, full.task.source_dictionary,
                                              full.task.target_dictionary), dirs[label], "int8")
                del model
            del full
            generator = torch.Generator().manual_seed(1)
            sources = [[f"p{int(i)}" for i in torch.randint(0, spec["tokens"] - 4, (SOURCE_TOKENS,), generator=generator)]
                       for _ in range(SENTENCES)]
            sources = [["eng_Latn" if target == "fra_Latn" else "__en__"] + s for s in sources]
            for threads in (1, 2):
                translators = {label: ctranslate2.Translator(str(d), device="cpu", intra_threads=threads,
                                                             compute_type="int8") for label, d in dirs.items()}
                options = dict(beam_size=BEAM, min_decoding_length=LENGTH, max_decoding_length=LENGTH,
                               target_prefix=[[target]] * SENTENCES, max_batch_size=SENTENCES)
                times: dict[str, list[float]] = {label: [] for label in translators}
                for translator in translators.values():
                    translator.translate_batch(sources[:4], **{**options, "target_prefix": [[target]] * 4})
                for _ in range(ROUNDS):
                    for label, translator in translators.items():
                        started = time.perf_counter()
                        translator.translate_batch(sources, **options)
                        times[label].append(time.perf_counter() - started)
                full_s, half_s = (statistics.median(times[label]) for label in ("unpruned", "half"))
                print(f"  {name:<26} {parameters / 1e6:>10.0f}M {seconds:>7.1f}s {peak_kb / 2**20:>10.1f} GiB  "
                      f"{threads:>7} {SENTENCES / full_s:>9.2f} {SENTENCES / half_s:>14.2f} {full_s / half_s:>8.2f}x")
                del translators


if __name__ == "__main__":
    main()
