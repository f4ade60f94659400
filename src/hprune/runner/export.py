"""`hprune export ckpt=PATH [mask=head_mask.json] format=ctranslate2|fairseq`: the model, with the masked heads
physically removed, in a runtime's format. fairseq: the pruned checkpoint (`prune.export=true` writes the same,
through the same code), checked against the masked model. ctranslate2: a CTranslate2 model directory built from
the pruned model, with the model's subword files and a README beside it, checked against hprune's model under
the mask before it is kept (deploy.ctranslate2.check_parity); its speed measured against the unpruned model's.
An export that computes otherwise than the masked model is one line, nothing written."""
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
PARITY_REFERENCES = 200  # reference translations whose log-probabilities the CTranslate2 export is checked on


def export(cfg: DictConfig) -> dict:
    from ..deploy import ctranslate2
    from ..session import Session  # imports fairseq, which fills Hydra's config store: only once composed

    if cfg.format not in FORMATS:
        raise UserError(f"format={cfg.format} is not one of {', '.join(FORMATS)}")
    if cfg.format == "ctranslate2":
        ctranslate2.check_quantization(cfg.quantization)
    session = Session.open(cfg)
    mask = session.fold_mechanisms(session.read_mask(cfg.mask) if cfg.mask else None) or session.unpruned_mask()
    out = run_dir()
    metrics = {"format": cfg.format, "mask": cfg.mask, **kept_columns(mask), **session.provenance()}
    if cfg.format == "fairseq":
        dest = out / "checkpoints" / "checkpoint_pruned.pt"
        metrics.update(session.export(mask, dest, session.evaluate(mask)))
        # the same runtime on both sides: translations may differ only where rounding breaks a tie
        tolerance = 1e-3 if cfg.precision == "fp32" else 0.5
        if not metrics["export_same_translations"] and metrics["export_max_abs_diff"] > tolerance:
            shutil.rmtree(dest.parent)
            raise UserError(f"the pruned checkpoint computes other outputs than the masked model (largest difference "
                            f"{metrics['export_max_abs_diff']:.2g}, above {tolerance:g}) and translates differently; "
                            "nothing was written")
        print(f"pruned checkpoint: {metrics['export_checkpoint']} ({metrics['params_removed_pct']} % fewer parameters, "
              f"BLEU {metrics['export_bleu']:.2f}, same translations as the masked model: "
              f"{'yes' if metrics['export_same_translations'] else 'NO'})")
        return metrics

    model = session.pruned_copy(mask)
    spec = ctranslate2.model_spec(model, session.loaded.cfg.model, *session.dictionaries)  # what it cannot hold: now
    dest = out / "ctranslate2"
    shutil.rmtree(dest, ignore_errors=True)  # an export run again into the same run dir is written anew
    subwords = session.subword_files()
    sources = session.source_tokens(cfg.split)
    limits = ctranslate2.length_limits(sources, cfg.generation, session.max_target_positions)
    with session.masked(mask):  # hprune's beam search on the masked model, the same split and settings
        masked, hprune_quality = session.translate()  # (BLEU only: no validation loss needed here)
    checked = {}

    def build(staging: Path) -> None:
        # the float32 model first: checked against hprune's before anything is kept
        ctranslate2.save(spec, staging, "none")
        with session.masked(mask):
            checked["translations"], checked["parity"] = ctranslate2.check_parity(
                str(staging), sources, masked.symbols, cfg.generation, limits,
                session.sentence_pairs(cfg.split, PARITY_REFERENCES), session,
                exact=cfg.precision == "fp32", device=session.device, threads=cfg.threads)
        failure = checked["parity"].failure()
        if failure:
            raise UserError(f"{failure}; nothing was written (docs/deploy.md, 'Checked on every export')")
        if cfg.quantization not in ("none", "float32"):
            for path in staging.iterdir():
                path.unlink()
            ctranslate2.save(ctranslate2.model_spec(model, session.loaded.cfg.model, *session.dictionaries), staging,
                             cfg.quantization)
            checked["translations"] = ctranslate2.translate(str(staging), sources, cfg.generation, limits,
                                                            session.device, cfg.threads)
        for path in subwords:
            shutil.copy(path, staging / path.name)
        write_atomic(staging / "README.md", ctranslate2.readme(session.data, [p.name for p in subwords], cfg.quantization))

    build_once(dest, "README.md", build)
    parity = checked["parity"]
    theirs, quality = session.score_symbols(checked["translations"], cfg.split)
    metrics.update({"split": cfg.split, "bleu": quality["bleu"], "bleu_hprune": hprune_quality["bleu"],
                    "bleu_signature": quality["bleu_signature"],
                    "translations_differ": sum(a != b for a, b in zip(theirs, masked.hypotheses)),
                    **parity.metrics()})

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
    alignment_layer, alignment_heads = ctranslate2.alignment(model.decoder)
    costs = session.unit_costs()
    macs = {name: mask_macs(costs, m, ATTENTION_TYPES)
            for name, m in (("mask", mask), ("ctranslate2", ctranslate2.padded_mask(mask, heads)),
                            ("unpruned", session.unpruned_mask()))}
    metrics.update({"export_dir": str(dest.absolute()), "quantization": cfg.quantization,
                    "ctranslate2_encoder_heads": heads["encoder"], "ctranslate2_decoder_heads": heads["decoder"],
                    "ctranslate2_alignment_layer": alignment_layer, "ctranslate2_alignment_heads": alignment_heads,
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
          f"{m['bleu_hprune']:.2f}; {m['translations_differ']} of {len(theirs)} translations differ: float32 "
          f"{parity.describe()}); heads per layer: "
          f"encoder {heads['encoder']}, decoder {heads['decoder']}; attention MACs {m['attention_macs_pct_ctranslate2']} "
          f"% of the unpruned model's (the mask's: {m['attention_macs_pct_mask']} %); {speed['free']['pruned']} "
          f"sentences/s against the unpruned model's {speed['free']['unpruned']} ({m['speedup_ctranslate2']}x, beam "
          f"{cfg.generation.beam}, {cfg.speed_split} split), {m['speedup_ctranslate2_fixed_length']}x with every "
          f"translation {length} tokens long (the same decoding steps)")
    return metrics


main = hydra_app("export")(export)
