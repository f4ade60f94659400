"""Beam search and teacher-forced batches over a split, exactly as fairseq-generate and fairseq-train read them
(but for a multilingual model's forced target-language token, scored as its own runtimes score it:
ForcedPrefixScoredZero)."""
from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

import torch
from fairseq import options
from fairseq.sequence_generator import SequenceGenerator
from omegaconf import DictConfig

from ..console import progress
from ..errors import UserError
from ..flops import Lengths
from .commands import generation_argv
from .compat import PLUGIN_DIR, frozen_heap, to_omegaconf
from .loading import Loaded


@dataclass
class BeamSearchResult:
    hypotheses: List[str]  # by sentence id, post-processed as fairseq-generate's D- lines
    symbols: List[List[str]]  # by sentence id, the same hypotheses as target symbols (no eos)
    sentences: int
    tokens: int
    seconds: float  # spent in beam search only, as fairseq-generate's own timer


@functools.lru_cache(maxsize=8)
def _generation_cfg(argv: tuple) -> DictConfig:
    """fairseq-generate's config for a command line; cached, as building it costs about a second and pruning
    runs translate dozens of times with the same settings."""
    return to_omegaconf(options.parse_args_and_arch(options.get_generation_parser(), list(argv)))


def translate(loaded: Loaded, gen: DictConfig, split: str, seed: int,
              post_process: Optional[str] = None, tokenizer: Optional[str] = None) -> BeamSearchResult:
    """Beam search over a split exactly as fairseq-generate does it (same batching, generator and post-processing)."""
    from fairseq import utils
    from fairseq.logging.meters import StopwatchMeter
    from fairseq_cli.generate import get_symbols_to_strip_from_output

    argv = [loaded.cfg.task.data, "--user-dir", PLUGIN_DIR, "--path", str(loaded.path)]
    argv += generation_argv(gen, split, seed)
    if post_process:
        argv += ["--post-process", post_process]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    if tokenizer == "moses":  # Moses takes its languages from the task's -s/-t, which must then be given
        argv += ["--source-lang", loaded.task.cfg.source_lang, "--target-lang", loaded.task.cfg.target_lang]
    if loaded.device == "cpu":
        argv.append("--cpu")
    cfg = _generation_cfg(tuple(argv))
    task, model = loaded.task, loaded.model
    source_positions = check_positions(loaded, split)  # loads the split
    dataset = task.dataset(split)
    model.prepare_for_inference_(cfg)
    itr = task.get_batch_iterator(
        dataset=dataset, max_tokens=cfg.dataset.max_tokens, max_sentences=cfg.dataset.batch_size,
        # sources as fairseq-generate limits them (checked above); no limit on the references, which the model
        # never reads (fairseq-generate refuses a longer one; its hypothesis is cut at the decoder's positions)
        max_positions=(source_positions, sys.maxsize),
        ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
        required_batch_size_multiple=cfg.dataset.required_batch_size_multiple, seed=cfg.common.seed,
        num_workers=cfg.dataset.num_workers, data_buffer_size=cfg.dataset.data_buffer_size,
        disable_iterator_cache=True,  # fairseq caches one iterator per split: another call's batches otherwise
    ).next_epoch_itr(shuffle=False)
    generator = build_generator(loaded, cfg)
    tokenizer_, bpe = task.build_tokenizer(cfg.tokenizer), task.build_bpe(cfg.bpe)

    def decode(text: str) -> str:
        text = bpe.decode(text) if bpe is not None else text
        return tokenizer_.decode(text) if tokenizer_ is not None else text

    timer = StopwatchMeter()
    hypotheses: dict[int, str] = {}
    symbols: dict[int, List[str]] = {}
    with frozen_heap(), progress(f"translate {split}", len(dataset), "sent", leave=False) as bar:
        for sample in itr:
            sample = utils.move_to_cuda(sample) if loaded.device == "cuda" else sample
            if "net_input" not in sample:
                continue
            timer.start()
            hypos = task.inference_step(generator, [model], sample, prefix_tokens=_prefix(loaded, sample))
            timer.stop(sum(len(h[0]["tokens"]) for h in hypos))
            for i, sample_id in enumerate(sample["id"].tolist()):
                best = hypos[i][0]
                # the hypothesis string of fairseq-generate's post_process_prediction, without its re-encoding of
                # that string with add_if_not_exist=True, which with BPE removal adds every de-BPE'd word to the
                # target dictionary, so the next generator built here would expect a larger vocabulary
                text = task.target_dictionary.string(
                    best["tokens"].int().cpu(), cfg.common_eval.post_process,
                    extra_symbols_to_ignore=get_symbols_to_strip_from_output(generator) | set(loaded.prefix_ids()))
                hypotheses[sample_id] = decode(text)
                ids = best["tokens"].tolist()
                symbols[sample_id] = [task.target_dictionary[t] for t in _without_eos(ids, generator.eos)]
            bar.advance(len(sample["id"]))
    missing = len(dataset) - len(hypotheses)
    if missing:
        raise RuntimeError(f"{missing} of {len(dataset)} {split} sentences were not translated")
    return BeamSearchResult([hypotheses[i] for i in range(len(dataset))], [symbols[i] for i in range(len(dataset))],
                        len(hypotheses), timer.n, timer.sum)


class ForcedPrefixScoredZero(SequenceGenerator):
    """fairseq's beam search with forced prefix tokens (a multilingual model's target language) scored 0, as the
    model's own runtimes score them (transformers' forced_bos_token_id, CTranslate2's target_prefix). fairseq's
    prefix_tokens count the token's log-probability: a constant in every hypothesis's score, but one that
    normalising by length (lenpen) weighs differently for different lengths, so beam search picked other
    translations than those runtimes (issue 50: NLLB sentence 29, -0.196 vs -0.198 one way, -0.144 vs -0.149 the
    other). Greedy search is unchanged."""

    def _prefix_tokens(self, step: int, lprobs, scores, tokens, prefix_tokens, beam_size: int):
        lprobs, tokens, scores = super()._prefix_tokens(step, lprobs, scores, tokens, prefix_tokens, beam_size)
        forced = prefix_tokens[:, step].unsqueeze(-1).repeat(1, beam_size).view(-1)
        rows = forced.ne(self.pad)
        lprobs[rows] = lprobs[rows].scatter(-1, forced[rows].unsqueeze(-1), 0.0)
        return lprobs, tokens, scores


def build_generator(loaded: Loaded, cfg: DictConfig) -> SequenceGenerator:
    """The task's beam search for the model with fairseq-generate's settings `cfg`."""
    return loaded.task.build_generator([loaded.model], cfg.generation,
                                       seq_gen_cls=ForcedPrefixScoredZero if loaded.prefix_ids() else None)


def _prefix(loaded: Loaded, sample: dict) -> Optional[torch.Tensor]:
    """The forced first target tokens of a batch (fairseq's prefix_tokens), or None."""
    ids = loaded.prefix_ids()
    if not ids:
        return None
    tokens = sample["net_input"]["src_tokens"]
    return torch.tensor(ids, device=tokens.device).expand(tokens.size(0), len(ids))


def batches(loaded: Loaded, split: str, max_tokens: Optional[int], max_batches: Optional[int] = None,
            shuffle_seed: Optional[int] = None, max_sentences: Optional[int] = None) -> Iterator[dict]:
    """Teacher-forcing batches of a split, on the model's device, in a fixed order (or shuffled with a seed)."""
    from fairseq import utils

    task = loaded.task
    load_split(loaded, split)
    itr = task.get_batch_iterator(
        dataset=task.dataset(split), max_tokens=max_tokens, max_sentences=max_sentences, required_batch_size_multiple=1,
        max_positions=utils.resolve_max_positions(task.max_positions(), loaded.model.max_positions()),
        ignore_invalid_inputs=True, seed=shuffle_seed or 1, num_workers=0,
        disable_iterator_cache=True,  # fairseq's cache would hand back the first call's batches, whatever the settings
    ).next_epoch_itr(shuffle=shuffle_seed is not None)
    for i, sample in enumerate(itr):
        if max_batches is not None and i >= max_batches:
            break
        if "net_input" in sample:
            yield utils.move_to_cuda(sample) if loaded.device == "cuda" else sample


def sampled_batches(loaded: Loaded, split: str, sentences: int, batch_size: int, seed: int) -> List[dict]:
    """`sentences` sentences drawn at random (without replacement, numpy's generator seeded with `seed`) from a
    split, in batches of `batch_size` in the order drawn: sentences of mixed lengths in one batch, as a shuffled
    data loader gives them, unlike fairseq's length-bucketed iterator. On the model's device."""
    import numpy as np
    from fairseq import utils

    load_split(loaded, split)
    dataset = loaded.task.dataset(split)
    drawn = np.random.default_rng(seed).permutation(len(dataset))[:sentences]
    batches = []
    for start in range(0, len(drawn), batch_size):
        sample = dataset.collater([dataset[int(i)] for i in drawn[start:start + batch_size]])
        batches.append(utils.move_to_cuda(sample) if loaded.device == "cuda" else sample)
    return batches


def split_lengths(loaded: Loaded, split: str) -> Lengths:
    """Every sentence's source and target length in tokens (eos included) of a binarized split, as fairseq's
    batches hold them: what MACs per target token are counted over."""
    load_split(loaded, split)
    dataset = loaded.task.dataset(split)
    return Lengths(dataset.src_sizes, dataset.tgt_sizes)


def split_symbols(loaded: Loaded, split: str, limit: Optional[int] = None) -> List[Tuple[List[str], List[str]]]:
    """The first `limit` (default: all) sentences of a binarized split as (source, target) symbols of the model's
    dictionaries, without eos or padding, in sentence-id order: the tokens another runtime (CTranslate2) or a
    word aligner is given."""
    source, target = loaded.task.source_dictionary, loaded.task.target_dictionary
    load_split(loaded, split)
    dataset = loaded.task.dataset(split)

    def symbols(ids, dictionary) -> List[str]:
        return [dictionary[t] for t in ids.tolist() if t not in (dictionary.pad(), dictionary.eos())]

    count = len(dataset) if limit is None else min(limit, len(dataset))
    return [(symbols(dataset.src[i], source), symbols(dataset.tgt[i], target)) for i in range(count)]


@torch.no_grad()
def token_log_probs(loaded: Loaded, pairs: List[Tuple[List[str], List[str]]], batch_size: int = 32) -> List[List[float]]:
    """Teacher-forced log-probability of each target token (the final eos's included) of (source, target)
    symbol pairs (no eos: both get one), under the model as it runs now (its head mask included), in batches;
    an fp32 log-softmax whatever the model's precision."""
    from fairseq.data import data_utils

    source, target = loaded.task.source_dictionary, loaded.task.target_dictionary
    loaded.model.eval()
    scored: List[List[float]] = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        src = [_ids(source, s) for s, _ in chunk]
        tgt = [_ids(target, t) for _, t in chunk]
        net_input = {"src_tokens": data_utils.collate_tokens(src, source.pad(), source.eos(), left_pad=True),
                     "src_lengths": torch.tensor([len(s) for s in src]),
                     "prev_output_tokens": data_utils.collate_tokens(tgt, target.pad(), target.eos(), left_pad=False,
                                                                     move_eos_to_beginning=True)}
        lprobs = loaded.model.get_normalized_probs(loaded.model(**_on_device(loaded, net_input)), log_probs=True)
        for b, ids in enumerate(tgt):
            scored.append(lprobs[b, torch.arange(len(ids)), ids.to(lprobs.device)].float().tolist())
    return scored


@torch.no_grad()
def translate_each(loaded: Loaded, gen: DictConfig, sources: List[List[str]], seed: int) -> List[List[str]]:
    """Beam search of each source (symbols, no eos) on its own, with fairseq's generator and `gen`: translate()
    without the batching, so that every sentence gets its own length limit. The best hypotheses as symbols."""
    argv = [loaded.cfg.task.data, "--user-dir", PLUGIN_DIR, "--path", str(loaded.path), *generation_argv(gen, "test", seed)]
    cfg = _generation_cfg(tuple(argv + (["--cpu"] if loaded.device == "cpu" else [])))
    loaded.model.eval()
    generator = build_generator(loaded, cfg)
    source, target = loaded.task.source_dictionary, loaded.task.target_dictionary
    hypotheses = []
    for symbols in sources:
        ids = _ids(source, symbols).unsqueeze(0)
        sample = _on_device(loaded, {"net_input": {"src_tokens": ids, "src_lengths": torch.tensor([ids.size(1)])}})
        best = loaded.task.inference_step(generator, [loaded.model], sample,
                                          prefix_tokens=_prefix(loaded, sample))[0][0]["tokens"].tolist()
        hypotheses.append([target[t] for t in _without_eos(best, target.eos())])
    return hypotheses


def _without_eos(ids: List[int], eos: int) -> List[int]:
    return ids[:-1] if ids[-1:] == [eos] else ids


def _ids(dictionary, symbols: List[str]) -> torch.Tensor:
    return torch.tensor([dictionary.index(w) for w in symbols] + [dictionary.eos()])


def _on_device(loaded: Loaded, sample: dict) -> dict:
    from fairseq import utils
    return utils.move_to_cuda(sample) if loaded.device == "cuda" else sample


def check_positions(loaded: Loaded, split: str) -> int:
    """The model's source positions (fairseq's limit on a source, eos included), after checking that every source
    of the split fits: fairseq's batching cannot take a longer one (fairseq-generate stops on it with a traceback,
    or skips it with --skip-invalid-size-inputs-valid-test), and a score without it, or with it cut, would not be
    the split's. One line names how many do not fit, which (the lines of the prepared source text) and the fix."""
    from fairseq import utils

    load_split(loaded, split)
    limit = utils.resolve_max_positions(loaded.task.max_positions(), loaded.model.max_positions())[0]
    sizes = loaded.task.dataset(split).src_sizes
    over = [int(i) for i in (sizes > limit).nonzero()[0]]
    if over:
        src = loaded.cfg.task.source_lang
        text = Path(loaded.cfg.task.data).parent / "raw" / f"{split}.{src}"
        where = f"line{'s' if len(over) > 1 else ''} {', '.join(str(i + 1) for i in over[:5])}" + \
            (f" and {len(over) - 5} more" if len(over) > 5 else "") + (f" of {text}" if text.is_file() else "")
        raise UserError(f"{len(over)} of {len(sizes)} {split} sentences have sources longer than the model's {limit} "
                        f"positions ({where}: up to {int(sizes[over].max())} tokens with eos), and hprune translates "
                        "every sentence of the split it scores; split or shorten those sentences in your source "
                        "and reference files and prepare the data again, or score another split")
    return int(limit)


def load_split(loaded: Loaded, split: str) -> None:
    """Check a split exists and is not empty, and read its binarized data once per loaded model (pruning runs
    translate and score it dozens of times)."""
    if split in loaded.task.datasets:
        return
    src, tgt = loaded.cfg.task.source_lang, loaded.cfg.task.target_lang
    source_bin = Path(loaded.cfg.task.data) / f"{split}.{src}-{tgt}.{src}.bin"
    if not source_bin.exists():
        raise UserError(f"{source_bin} is missing; run `hprune data prepare` for this data set, or pick a split "
                        "it has (train, valid, test)")
    if source_bin.stat().st_size == 0:  # fairseq cannot even open an empty split
        raise UserError(f"the {split} split in {loaded.cfg.task.data} is empty; pick another split")
    loaded.task.load_dataset(split, task_cfg=loaded.cfg.task)


@torch.no_grad()
def split_loss(loaded: Loaded, criterion, split: str, max_tokens: int) -> dict:
    """The criterion's loss and the NLL per target token on a split, in bits, as fairseq's validation reports."""
    loaded.model.eval()
    loss = nll = sample_size = ntokens = 0.0
    for sample in batches(loaded, split, max_tokens):
        value, size, logging = criterion(loaded.model, sample)
        loss, nll = loss + float(value), nll + float(logging["nll_loss"])
        sample_size, ntokens = sample_size + size, ntokens + logging["ntokens"]
    return {"loss": loss / sample_size / math.log(2), "nll_loss": nll / ntokens / math.log(2)}


def _detokenizer(tokenizer: Optional[str], src: str, tgt: str):
    """fairseq's --tokenizer (its decode undoes it), or None."""
    from argparse import Namespace

    from fairseq.data import encoders

    return encoders.build_tokenizer(Namespace(tokenizer=tokenizer, moses_source_lang=src, moses_target_lang=tgt,
                                              moses_no_dash_splits=False, moses_no_escape=False)) if tokenizer else None


def symbols_to_text(loaded: Loaded, post_process: Optional[str] = None,
                    tokenizer: Optional[str] = None) -> Callable[[List[str]], str]:
    """Target symbols another runtime produced, as the text of fairseq-generate's hypothesis (translate's): the
    dictionary's post-processing (BPE removed), then the detokenizer."""
    dictionary = loaded.task.target_dictionary
    detok = _detokenizer(tokenizer, loaded.cfg.task.source_lang, loaded.cfg.task.target_lang)

    def text(symbols: List[str]) -> str:
        line = dictionary.string(torch.tensor([dictionary.index(s) for s in symbols], dtype=torch.long), post_process,
                                 extra_symbols_to_ignore=set(loaded.prefix_ids()))
        return detok.decode(line) if detok is not None else line
    return text


def split_targets(data_bin: Path, split: str, src: str, tgt: str, post_process: Optional[str] = None,
                  tokenizer: Optional[str] = None) -> List[str]:
    """The target side of a binarized split as text, as fairseq-generate prints its T- lines (BPE removed,
    detokenized): the references of a data-bin that came without its raw text."""
    from fairseq.data import Dictionary, data_utils

    dictionary = Dictionary.load(str(Path(data_bin) / f"dict.{tgt}.txt"))
    dataset = data_utils.load_indexed_dataset(str(Path(data_bin) / f"{split}.{src}-{tgt}.{tgt}"), dictionary)
    if dataset is None:
        raise UserError(f"{data_bin} has no {split} split with {tgt} targets ({split}.{src}-{tgt}.{tgt}.bin)")
    detok = _detokenizer(tokenizer, src, tgt)
    lines = []
    for i in range(len(dataset)):
        text = dictionary.string(dataset[i], post_process, escape_unk=True)
        lines.append(detok.decode(text) if detok is not None else text)
    return lines
