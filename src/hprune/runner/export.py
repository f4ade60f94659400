"""`hprune export ckpt=PATH [mask=head_mask.json] format=ctranslate2|fairseq`: the model, with the masked heads
physically removed, in a runtime's format. fairseq: the pruned checkpoint (`prune.export=true` writes the same,
through the same code), checked against the masked model. ctranslate2: a CTranslate2 model directory built from
the pruned model, with the model's subword files and a README beside it."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from omegaconf import DictConfig

from ..attention_types import ATTENTION_TYPES
from ..errors import UserError
from ..files import build_once, run_dir, write_atomic
from ..flops import mask_macs
from ..pruning.heads import kept_columns
from . import hydra_app

FORMATS = ("ctranslate2", "fairseq")


def export(cfg: DictConfig) -> dict:
    from ..deploy import ctranslate2
    from ..session import Session  # imports fairseq, which fills Hydra's config store: only once composed

    if cfg.format not in FORMATS:
        raise UserError(f"format={cfg.format} is not one of {', '.join(FORMATS)}")
    if cfg.format == "ctranslate2":
        ctranslate2.check_quantization(cfg.quantization)
    session = Session.open(cfg)
    mask = session.fold_gates(session.read_mask(cfg.mask) if cfg.mask else None) or session.unpruned_mask()
    out = run_dir()
    metrics = {"format": cfg.format, "mask": cfg.mask, **kept_columns(mask), **session.provenance()}
    if cfg.format == "fairseq":
        metrics.update(session.export(mask, out / "checkpoints" / "checkpoint_pruned.pt",
                                      session.evaluate(mask)))
        print(f"pruned checkpoint: {metrics['export_checkpoint']} ({metrics['params_removed_pct']} % fewer parameters, "
              f"BLEU {metrics['export_bleu']:.2f}, same translations as the masked model: "
              f"{'yes' if metrics['export_same_translations'] else 'NO'})")
        return metrics

    model = session.pruned_copy(mask)
    spec = ctranslate2.model_spec(model, session.loaded.cfg.model, *session.dictionaries)
    dest = out / "ctranslate2"
    shutil.rmtree(dest, ignore_errors=True)  # an export run again into the same run dir is written anew
    subwords = session.subword_files()

    def build(staging: Path) -> None:
        ctranslate2.save(spec, staging, cfg.quantization)
        for path in subwords:
            shutil.copy(path, staging / path.name)
        write_atomic(staging / "README.md", ctranslate2.readme(session.data, [p.name for p in subwords], cfg.quantization))

    build_once(dest, "README.md", build)

    # quality: the export's beam search against hprune's on the masked model, the same split and settings
    with session.masked(mask):  # BLEU only: no validation loss needed here
        masked, hprune_quality = session.translate()
    theirs, quality = session.score_symbols(
        ctranslate2.translate(str(dest), session.source_tokens(cfg.split), cfg.generation, session.device, cfg.threads),
        cfg.split)
    metrics.update({"split": cfg.split, "bleu": quality["bleu"], "bleu_hprune": hprune_quality["bleu"],
                    "bleu_signature": quality["bleu_signature"],
                    "translations_differ": sum(a != b for a, b in zip(theirs, masked.hypotheses))})

    # speed in CTranslate2: this export against the unpruned model written the same way
    with tempfile.TemporaryDirectory() as unpruned:
        ctranslate2.save(ctranslate2.model_spec(session.pruned_copy(session.unpruned_mask()), session.loaded.cfg.model,
                                                *session.dictionaries), unpruned, cfg.quantization)
        models, sources = {"pruned": str(dest), "unpruned": unpruned}, session.source_tokens(cfg.speed_split)
        length = max(1, round(sum(map(len, sources)) / len(sources)))  # the sources' mean length
        measured = ctranslate2.sentences_per_s(models, sources, cfg.generation.beam, cfg.threads,
                                               device=session.device, lengths=(None, length))
        speed = {"free": measured[None], "fixed": measured[length]}
    heads = ctranslate2.stack_heads(model)
    costs = session.unit_costs()
    macs = {name: mask_macs(costs, m, ATTENTION_TYPES)
            for name, m in (("mask", mask), ("ctranslate2", ctranslate2.padded_mask(mask, heads)),
                            ("unpruned", session.unpruned_mask()))}
    metrics.update({"export_dir": str(dest.absolute()), "quantization": cfg.quantization,
                    "ctranslate2_encoder_heads": heads["encoder"], "ctranslate2_decoder_heads": heads["decoder"],
                    "attention_macs_pct_mask": round(100 * macs["mask"] / macs["unpruned"], 2),
                    "attention_macs_pct_ctranslate2": round(100 * macs["ctranslate2"] / macs["unpruned"], 2),
                    "subword_files": [p.name for p in subwords], "speed_split": cfg.speed_split,
                    "sentences_per_s_ctranslate2": speed["free"]["pruned"],
                    "sentences_per_s_ctranslate2_unpruned": speed["free"]["unpruned"],
                    "speedup_ctranslate2": round(speed["free"]["pruned"] / speed["free"]["unpruned"], 3),
                    "decoding_length_fixed": length,
                    "speedup_ctranslate2_fixed_length": round(speed["fixed"]["pruned"] / speed["fixed"]["unpruned"], 3)})
    m = metrics
    print(f"CTranslate2 model: {dest} ({cfg.quantization}); BLEU {m['bleu']:.2f} on {cfg.split} (hprune, masked: "
          f"{m['bleu_hprune']:.2f}; {m['translations_differ']} of {len(theirs)} translations differ); heads per layer: "
          f"encoder {heads['encoder']}, decoder {heads['decoder']}; attention MACs {m['attention_macs_pct_ctranslate2']} "
          f"% of the unpruned model's (the mask's: {m['attention_macs_pct_mask']} %); {speed['free']['pruned']} "
          f"sentences/s against the unpruned model's {speed['free']['unpruned']} ({m['speedup_ctranslate2']}x, beam "
          f"{cfg.generation.beam}, {cfg.speed_split} split), {m['speedup_ctranslate2_fixed_length']}x with every "
          f"translation {length} tokens long (the same decoding steps)")
    return metrics


main = hydra_app("export")(export)
