"""An opened model: a checkpoint with its data, task, criterion and device, and what verbs do with a model.

Every verb that measures a model starts with `Session.open(cfg)` (resolve the checkpoint, prepare the data,
load the model safely) and then asks the session: translate and score a split, evaluate under a head mask
(the previous mask is put back), fine-tune with a mask held fixed,
export a physically pruned copy and check it, reopen another checkpoint on the same data, and the provenance
keys of metrics.json. Only the session and the backend touch fairseq's objects.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator, Optional, Tuple

import pandas as pd
import torch
from omegaconf import DictConfig

from . import backend
from .data.kinds import get_kind
from .data.prepare import bind, model_languages, prepare, test_set_of
from .errors import UserError
from .flops import macs_per_token, mask_macs, unit_costs
from .pruning.heads import Mask, kept_ids, layout, mask_without, read_mask

log = logging.getLogger(__name__)


def read_references(raw_file: Path, n: int) -> list[str]:
    if not raw_file.exists():
        raise UserError(f"references {raw_file} are missing; run `hprune data prepare` again")
    refs = raw_file.read_text().splitlines()
    if len(refs) != n:
        raise UserError(f"{raw_file} has {len(refs)} lines but the binarized split has {n}; "
                        "delete the data folder and prepare it again")
    return refs


def delta_bleu(result: dict, reference: dict) -> float:
    """BLEU of one evaluation minus another's (Session.evaluate's results), as every table records it."""
    return round(result["bleu"] - reference["bleu"], 4)


def score(hypotheses: list[str], references: list[str]) -> dict:
    from sacrebleu.metrics import BLEU, CHRF

    bleu, chrf = BLEU(), CHRF()
    return {"bleu": round(bleu.corpus_score(hypotheses, [references]).score, 4),
            "bleu_signature": str(bleu.get_signature()),
            "chrf": round(chrf.corpus_score(hypotheses, [references]).score, 4),
            "chrf_signature": str(chrf.get_signature())}


class Session:
    def __init__(self, cfg: DictConfig, data: DictConfig, loaded: backend.Loaded, data_bin: Path, criterion=None):
        self.cfg, self.data, self.loaded, self.data_bin = cfg, data, loaded, data_bin
        self._criterion = criterion
        self._mask: Optional[Mask] = None
        self._unit_costs = None

    @classmethod
    def open(cls, cfg: DictConfig, ckpt: str | Path | None = None) -> "Session":
        """cfg: a verb's config (ckpt, data, paths, device, precision, and generation where it translates)."""
        if cfg.get("generation") is not None:
            backend.check_generation(cfg.generation)  # before any work, not at the first translation
        path = backend.resolve_checkpoint(cfg.ckpt if ckpt is None else ckpt, cfg.paths.models_root)
        checkpoint = backend.read_checkpoint(path)
        if not all(checkpoint.languages):
            checkpoint.set_languages(*model_languages(cfg.data, checkpoint))
        data = bind(cfg.data, checkpoint.path, checkpoint.languages)  # a model's own data: from its folder
        data_bin = prepare(data, cfg.paths.data_root)
        session = cls(cfg, data, backend.load_model(checkpoint, data_bin, cfg.device, cfg.precision), data_bin)
        log.info("model %s (%s parameters) on %s, %s; data %s", session.checkpoint, f"{session.n_params():,}",
                 session.device, cfg.get("precision", "fp32"), data.name)
        return session

    def reopen(self, ckpt: Path) -> "Session":
        """Another checkpoint (exported, retrained, gated) on this session's data and settings, measured with this
        session's criterion (what a gated checkpoint adds to its loss goes when its gates are folded)."""
        languages = (self.loaded.cfg.task.source_lang, self.loaded.cfg.task.target_lang)
        return Session(self.cfg, self.data,
                       backend.load_model(ckpt, self.data_bin, self.cfg.device, self.cfg.precision, languages),
                       self.data_bin, self.criterion)

    # ---------------------------------------------------------------------------------------- the model
    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @property
    def checkpoint(self) -> Path:
        return self.loaded.path

    @property
    def device(self) -> str:
        return self.loaded.device

    @property
    def pad(self) -> int:
        return self.loaded.task.target_dictionary.pad()

    @property
    def eos(self) -> int:
        return self.loaded.task.target_dictionary.eos()

    def source_count(self, token: int) -> int:
        """How often a source token occurred in the data its dictionary was built from."""
        return self.loaded.task.source_dictionary.count[token]

    @property
    def criterion(self):
        """The training criterion recorded in the checkpoint (built at first use)."""
        if self._criterion is None:
            self._criterion = backend.build_criterion(self.loaded)
        return self._criterion

    def n_params(self) -> int:
        return backend.count_parameters(self.model)

    def read_mask(self, path: str | Path, key: str = "mask", soft: bool = False) -> Mask:
        return read_mask(path, layout(self.model), key, soft)

    def fold_mechanisms(self, mask: Optional[Mask]) -> Optional[Mask]:
        """A checkpoint trained with a pruning mechanism (gates, a subset selector) as `hprune prune` reads it out:
        each gated head that `mask` keeps (default: the mechanism's own read-out) gets its deterministic value
        folded into the weights (its full output where that value is 0), every other gated head 0 (the plugin's
        model.fold_mechanisms). The mask of the heads kept is returned. A model without one: `mask` as given."""
        gated = [(kind, layer, h) for kind, layer, m in self.model.gated_modules() for h in m.head_ids]
        kept = self.model.fold_mechanisms(mask)
        if gated:
            log.info("gates folded into the weights: %d of %d gated heads kept",
                     sum(kept[kind][layer][h] for kind, layer, h in gated), len(gated))
        return kept

    def state(self) -> dict:
        """A CPU copy of the weights (restored with load_state)."""
        return {name: tensor.detach().cpu().clone() for name, tensor in self.model.state_dict().items()}

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state)

    # ---------------------------------------------------------------------------------------- masks
    def set_mask(self, mask: Optional[Mask]) -> None:
        """The head mask the model runs under from now on (None: every head present)."""
        self.model.set_head_mask(mask)
        self._mask = mask

    @contextlib.contextmanager
    def masked(self, mask: Optional[Mask]):
        """Run under `mask` for a while; the previous mask is put back afterwards."""
        previous = self._mask
        self.set_mask(mask)
        try:
            yield
        finally:
            self.set_mask(previous)

    # ---------------------------------------------------------------------------------------- data
    def batches(self, split: str, max_tokens: Optional[int], max_batches: Optional[int] = None,
                shuffle_seed: Optional[int] = None, max_sentences: Optional[int] = None) -> Iterator[dict]:
        return backend.batches(self.loaded, split, max_tokens, max_batches, shuffle_seed, max_sentences)

    def sampled_batches(self, split: str, sentences: int, batch_size: int, seed: int) -> list[dict]:
        return backend.sampled_batches(self.loaded, split, sentences, batch_size, seed)

    def test_set(self, split: str) -> Optional[str]:
        return test_set_of(self.data_bin, split)

    # ---------------------------------------------------------------------------------------- measuring
    def translate(self, split: Optional[str] = None) -> Tuple[backend.BeamSearchResult, dict]:
        """Beam search on a split (cfg.split) with cfg.generation, scored against the split's raw references:
        (translations, {bleu, chrf and their signatures})."""
        cfg, split = self.cfg, split or self.cfg.split
        result = backend.translate(self.loaded, cfg.generation, split, cfg.seed, self.data.post_process,
                                   self._detokenizer)
        return result, score(result.hypotheses, self.references(split, result.sentences))

    @property
    def _detokenizer(self) -> Optional[str]:
        return "moses" if self.data.get("tokenizer") == "moses" else None  # null/none: nothing to undo

    def score_symbols(self, hypotheses: list[list[str]], split: str) -> Tuple[list[str], dict]:
        """Another runtime's translations of a split, as target symbols: their text as `translate` writes it, and
        its scores against the split's references."""
        text = backend.symbols_to_text(self.loaded, self.data.post_process, self._detokenizer)
        lines = [text(symbols) for symbols in hypotheses]
        return lines, score(lines, self.references(split, len(lines)))

    def score_pairs(self, pairs: list[tuple[list[str], list[str]]]) -> list[list[float]]:
        """Teacher-forced log-probability of each target token (eos included) of (source, target) symbol pairs,
        under the current mask."""
        return backend.token_log_probs(self.loaded, pairs)

    def translate_each(self, sources: list[list[str]], generation: DictConfig) -> list[list[str]]:
        """Beam search of each source (symbols) on its own, under the current mask: its best hypothesis's symbols."""
        return backend.translate_each(self.loaded, generation, sources, self.cfg.seed)

    @property
    def max_target_positions(self) -> int:
        return self.model.max_decoder_positions()

    def references(self, split: str, sentences: int) -> list[str]:
        return read_references(self.data_bin.parent / "raw" / f"{split}.{self.data.tgt_lang}", sentences)

    def loss(self, split: str, max_tokens: int) -> dict:
        return backend.split_loss(self.loaded, self.criterion, split, max_tokens)

    def evaluate(self, mask: Optional[Mask]) -> dict:
        """BLEU/chrF on cfg.split and the loss on cfg.loss_split under `mask` (None: every head present)."""
        with self.masked(mask):
            result, quality = self.translate()
            loss = self.loss(self.cfg.loss_split, self.cfg.max_tokens)
        return {"bleu": quality["bleu"], "chrf": quality["chrf"], "bleu_signature": quality["bleu_signature"],
                "valid_loss": round(loss["loss"], 4),
                "sentences_per_s": round(result.sentences / result.seconds, 2), "hypotheses": result.hypotheses,
                "references": self.references(self.cfg.split, result.sentences)}

    def costs(self, split: str) -> Tuple[dict, pd.DataFrame]:
        """Parameters and counted MACs per target token (whole model and attention); on MoA models, the MoA
        settings and how evenly the experts are used (the per-expert table, empty on other models)."""
        from .analysis.moa import expert_load, load_summary

        costs = {"n_params": self.n_params(),
                 **macs_per_token(self.model, next(self.batches(split, self.cfg.max_tokens, 1)))}
        load = expert_load(self.model, self.batches(split, self.cfg.max_tokens))
        if not load.empty:
            model_cfg = self.loaded.cfg.model  # the MoA settings as the checkpoint records them
            costs.update({key: getattr(model_cfg, key) for key in ("moa_experts", "moa_top_k", "moa_head_dim", "moa_types")},
                         **load_summary(load))
        return costs, load

    def unit_costs(self) -> dict:
        """What each attention sublayer's heads cost in MACs per target token (flops.unit_costs), counted once
        per session on a batch of loss_split, with the heads the model has now."""
        if self._unit_costs is None:
            self._unit_costs = unit_costs(self.model, next(self.batches(self.cfg.loss_split, self.cfg.max_tokens, 1)))
        return self._unit_costs

    def attention_macs_pct(self, mask: Mask, types) -> float:
        """Attention MACs per target token of the sublayers of `types` under `mask`, as a percentage of those
        of every head the model has now."""
        full = mask_macs(self.unit_costs(), self.unpruned_mask(), types)
        return round(100 * mask_macs(self.unit_costs(), mask, types) / full, 2) if full else 0.0

    # ---------------------------------------------------------------------------------------- changing
    def finetune(self, mask: Optional[Mask], updates: int, lr: float, max_tokens: int, seed: int) -> None:
        """Adam updates on the train split with `mask` held fixed (masked heads get no gradient); the model
        stays under that mask."""
        self.set_mask(mask)
        backend.finetune(self.loaded, self.criterion, updates, lr, max_tokens, seed)

    def export(self, mask: Mask, dest: Path, masked: dict, config_from: Optional[Path] = None) -> dict:
        """Physically remove the masked heads into `dest`, reopen it, and check it against this model under the
        mask (`masked`: evaluate(mask) of it): largest output difference, BLEU, same translations, size, MACs
        per target token counted on both (whole model and attention) and speed. config_from: see
        backend.export_pruned."""
        backend.export_pruned(self.loaded, kept_ids(mask), dest, config_from)
        pruned = self.reopen(dest)
        sample = next(self.batches(self.cfg.loss_split, self.cfg.max_tokens, 1))
        with torch.no_grad(), self.masked(mask):
            reference = self.model(**sample["net_input"])[0].float()
            difference = (pruned.model(**sample["net_input"])[0].float() - reference).abs().max().item()
        result = pruned.evaluate(None)
        same = result["hypotheses"] == masked["hypotheses"]
        if not same:
            log.warning("the physically pruned model's translations differ from the masked model's")
        n_params, n_params_pruned = self.n_params(), pruned.n_params()
        counted = {name: macs_per_token(session.model, sample) for name, session in (("unpruned", self), ("pruned", pruned))}
        return {"export_checkpoint": str(dest.absolute()), "export_max_abs_diff": difference,
                "export_bleu": result["bleu"], "export_same_translations": same, "n_params_pruned": n_params_pruned,
                "params_removed_pct": round(100 * (1 - n_params_pruned / n_params), 2),
                **{f"{key}_{name}": value for name, macs in counted.items() for key, value in macs.items()},
                "macs_removed_pct": round(100 * (1 - counted["pruned"]["macs_per_token"]
                                                 / counted["unpruned"]["macs_per_token"]), 2),
                "sentences_per_s_masked": masked["sentences_per_s"], "sentences_per_s_pruned": result["sentences_per_s"]}

    def pruned_copy(self, mask: Mask) -> torch.nn.Module:
        """An fp32 CPU copy of the model with the heads `mask` drops physically removed."""
        return backend.pruned_model(self.loaded, kept_ids(mask))

    @property
    def dictionaries(self) -> tuple:
        """The model's (source, target) fairseq dictionaries."""
        return self.loaded.task.source_dictionary, self.loaded.task.target_dictionary

    def source_tokens(self, split: str) -> list[list[str]]:
        """The source side of a split as the model's tokens (no eos), in sentence order."""
        return [source for source, _ in self.sentence_pairs(split)]

    def sentence_pairs(self, split: str, limit: Optional[int] = None) -> list[tuple[list[str], list[str]]]:
        """The first `limit` (default: all) sentences of a split as (source, target) tokens, in sentence order."""
        return backend.split_symbols(self.loaded, split, limit)

    def subword_files(self) -> list[Path]:
        """The files that turn text into the model's tokens (the data kind's: a published or imported model's
        codes or sentencepiece models, the BPE codes or sentencepiece model hprune learnt for a WMT data set;
        data sets prepared before issue 27 lack the copy: prepare them again); none for the others."""
        kind = get_kind(self.data)
        return [] if kind.subwords is None else kind.subwords(self.data, self.data_bin.parent)

    def continue_training_argv(self, save_dir: Path, seed: int, criterion: str, options: list) -> list:
        """fairseq-train flags that continue training this checkpoint (its architecture and label smoothing as
        recorded) with `criterion` and the caller's options."""
        cfg = self.loaded.cfg
        smoothing = cfg.criterion.get("label_smoothing", 0.0) if cfg.criterion is not None else 0.0
        return backend.continue_training_argv(
            self.checkpoint, cfg.model, cfg.task, self.data_bin, save_dir, self.cfg.device, self.cfg.precision, seed,
            ["--criterion", criterion, "--label-smoothing", str(smoothing), *options,
             *backend.tensorboard_flags(self.cfg, save_dir)])

    def unpruned_mask(self) -> Mask:
        return mask_without(self.model, ())

    # ---------------------------------------------------------------------------------------- provenance
    def provenance(self) -> dict:
        """The keys of metrics.json that say which model, data and device a verb measured."""
        return {"checkpoint": str(self.checkpoint.absolute()), "data_bin": str(self.data_bin), "device": self.device,
                "n_params": self.n_params(), "imported_from": self.loaded.imported_from}
