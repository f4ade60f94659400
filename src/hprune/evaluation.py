"""Measuring an opened model (a Session): beam search scored with sacreBLEU, teacher-forced losses, counted
costs, under explicit settings (`Measure`, from a verb's config: configs/measure/) with typed results
(`Quality`, `Evaluation`).

    evaluator = Evaluator.of(session, cfg)
    unpruned = evaluator.evaluate(None)
    pruned = evaluator.evaluate(mask)          # the session's previous mask is put back
    pruned.delta_bleu(unpruned)
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pandas as pd
from omegaconf import DictConfig

from . import backend
from .bleu import DEFAULT_TOKENIZE, tokenize_of
from .errors import UserError
from .flops import Lengths, macs_per_token, mask_macs, unit_costs
from .pruning.heads import Mask


@dataclass(frozen=True)
class Measure:
    """What an evaluation is measured on (the shared config group configs/measure/)."""
    split: str  # beam search, BLEU and chrF
    loss_split: str  # teacher-forced passes: the validation loss, MAC counts
    max_tokens: int  # tokens per teacher-forced batch
    seed: int
    generation: Optional[DictConfig] = None  # beam search settings (configs/generation/); None: no translation

    @classmethod
    def of(cls, cfg: DictConfig) -> "Measure":
        return cls(cfg.split, cfg.loss_split, cfg.max_tokens, cfg.seed, cfg.get("generation"))


@dataclass(frozen=True)
class Quality:
    """sacreBLEU's corpus scores of detokenized hypotheses against raw references, with their signatures."""
    bleu: float
    bleu_signature: str
    chrf: float
    chrf_signature: str

    def columns(self) -> dict:
        return dataclasses.asdict(self)


def score(hypotheses: List[str], references: List[str], tokenize: str = DEFAULT_TOKENIZE) -> Quality:
    """`tokenize`: sacreBLEU's tokenization for BLEU (the data set's `bleu_tokenize`; none: the text's own tokens,
    as fairseq-generate scores a tokenized test set such as IWSLT14's)."""
    from sacrebleu.metrics import BLEU, CHRF

    bleu, chrf = BLEU(tokenize=tokenize), CHRF()
    return Quality(bleu=round(bleu.corpus_score(hypotheses, [references]).score, 4),
                   bleu_signature=str(bleu.get_signature()),
                   chrf=round(chrf.corpus_score(hypotheses, [references]).score, 4),
                   chrf_signature=str(chrf.get_signature()))


@dataclass(frozen=True)
class Evaluation:
    """A model under one mask: BLEU/chrF on the measure's split, the loss (bits per token) on its loss split, beam
    search speed, and the translations with their references (for paired tests and the saved hypotheses)."""
    bleu: float
    chrf: float
    bleu_signature: str
    valid_loss: float
    sentences_per_s: float
    hypotheses: List[str] = field(repr=False)
    references: List[str] = field(repr=False)

    @property
    def bleu_tokenize(self) -> str:
        return tokenize_of(self.bleu_signature)

    def delta_bleu(self, reference: "Evaluation") -> float:
        """This BLEU minus another evaluation's, as every table records it."""
        return round(self.bleu - reference.bleu, 4)


def read_references(raw_file: Path, n: int) -> List[str]:
    if not raw_file.exists():
        raise UserError(f"references {raw_file} are missing; run `hprune data prepare` again")
    refs = raw_file.read_text().splitlines()
    if len(refs) != n:
        raise UserError(f"{raw_file} has {len(refs)} lines but the binarized split has {n}; "
                        "delete the data folder and prepare it again")
    return refs


class Evaluator:
    """A session measured under a Measure. The costs of its heads are counted once per evaluator."""

    def __init__(self, session, measure: Measure):
        self.session, self.measure = session, measure
        self._unit_costs: Optional[dict] = None

    @classmethod
    def of(cls, session, cfg: DictConfig) -> "Evaluator":
        return cls(session, Measure.of(cfg))

    def on(self, session) -> "Evaluator":
        """Another session (a checkpoint reopened on this one's data: Session.reopen), measured the same way."""
        return Evaluator(session, self.measure)

    def reopen(self, ckpt: Path) -> "Evaluator":
        return self.on(self.session.reopen(ckpt))

    # ------------------------------------------------------------------------------------------ translations
    def translate(self, split: Optional[str] = None) -> Tuple[backend.BeamSearchResult, Quality]:
        """Beam search on a split (default: the measure's) under the session's mask, scored against the split's
        raw references."""
        session, split = self.session, split or self.measure.split
        result = backend.translate(session.loaded, self.measure.generation, split, self.measure.seed,
                                   session.data.post_process, self._detokenizer)
        return result, score(result.hypotheses, self.references(split, result.sentences), self.bleu_tokenize)

    @property
    def bleu_tokenize(self) -> str:
        return self.session.data.get("bleu_tokenize") or DEFAULT_TOKENIZE

    @property
    def _detokenizer(self) -> Optional[str]:
        return "moses" if self.session.data.get("tokenizer") == "moses" else None  # null/none: nothing to undo

    def references(self, split: str, sentences: int) -> List[str]:
        return read_references(self.session.prepared.raw_file(f"{split}.{self.session.data.tgt_lang}"), sentences)

    def score_symbols(self, hypotheses: List[List[str]], split: str) -> Tuple[List[str], Quality]:
        """Another runtime's translations of a split, as target symbols: their text as `translate` writes it, and
        its scores against the split's references."""
        session = self.session
        text = backend.symbols_to_text(session.loaded, session.data.post_process, self._detokenizer)
        lines = [text(symbols) for symbols in hypotheses]
        return lines, score(lines, self.references(split, len(lines)), self.bleu_tokenize)

    def score_pairs(self, pairs: List[Tuple[List[str], List[str]]]) -> List[List[float]]:
        """Teacher-forced log-probability of each target token (eos included) of (source, target) symbol pairs,
        under the session's mask."""
        return backend.token_log_probs(self.session.loaded, pairs)

    def translate_each(self, sources: List[List[str]], generation: DictConfig) -> List[List[str]]:
        """Beam search of each source (symbols) on its own, under the session's mask: its best hypothesis's
        symbols."""
        return backend.translate_each(self.session.loaded, generation, sources, self.measure.seed)

    # ------------------------------------------------------------------------------------------ evaluation
    def loss(self, split: Optional[str] = None) -> float:
        """The criterion's loss per target token, in bits, on a split (default: the loss split)."""
        session = self.session
        found = backend.split_loss(session.loaded, session.criterion, split or self.measure.loss_split,
                                   self.measure.max_tokens)
        return found["loss"]

    def evaluate(self, mask: Optional[Mask]) -> Evaluation:
        """BLEU/chrF on the split and the loss on the loss split under `mask` (None: every head present)."""
        with self.session.masked(mask):
            result, quality = self.translate()
            loss = self.loss()
        return Evaluation(bleu=quality.bleu, chrf=quality.chrf, bleu_signature=quality.bleu_signature,
                          valid_loss=round(loss, 4), sentences_per_s=round(result.sentences / result.seconds, 2),
                          hypotheses=result.hypotheses, references=self.references(self.measure.split, result.sentences))

    # ------------------------------------------------------------------------------------------ costs
    def costs(self, split: Optional[str] = None) -> Tuple[dict, pd.DataFrame]:
        """Parameters and counted MACs per target token (whole model and attention) on a split (default: the
        measure's); on MoA models, the MoA settings and how evenly the experts are used (the per-expert table,
        empty on other models)."""
        from .analysis.moa import expert_load, load_summary

        session, split, max_tokens = self.session, split or self.measure.split, self.measure.max_tokens
        costs = {"n_params": session.n_params(), **macs_per_token(session.model, self.lengths(split))}
        load = expert_load(session.model, session.batches(split, max_tokens))
        if not load.empty:
            model_cfg = self.session.model_config  # the MoA settings as the checkpoint records them
            costs.update({key: getattr(model_cfg, key) for key in ("moa_experts", "moa_top_k", "moa_head_dim", "moa_types")},
                         **load_summary(load))
        return costs, load

    def lengths(self, split: Optional[str] = None) -> Lengths:
        """The sentences of a split (default: the loss split) MACs per target token are counted over: all of them,
        each at its own length."""
        return backend.split_lengths(self.session.loaded, split or self.measure.loss_split)

    def unit_costs(self) -> dict:
        """What each attention sublayer's heads (and each FFN's neurons) cost in MACs per target token
        (flops.unit_costs), counted once over the whole loss split, with the units the model has now."""
        if self._unit_costs is None:
            self._unit_costs = unit_costs(self.session.model, self.lengths())
        return self._unit_costs

    @contextlib.contextmanager
    def parked(self, folder: Path) -> Iterator[None]:
        """The session's weights parked in `folder` for the block (Session.parked), once what this evaluator's
        metrics take from them has been counted: the units' MACs (the parameter count: the session keeps it)."""
        self.unit_costs()
        with self.session.parked(folder):
            yield

    def attention_macs_pct(self, mask: Mask, types) -> float:
        """Attention MACs per target token of the sublayers of `types` under `mask`, as a percentage of those
        of every head the model has now."""
        full = mask_macs(self.unit_costs(), self.session.unpruned_mask(), types)
        return round(100 * mask_macs(self.unit_costs(), mask, types) / full, 2) if full else 0.0
