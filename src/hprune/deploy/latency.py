"""A latency table of a model in CTranslate2, measured on this machine (Kwon et al.'s latency constraint: their
generate_lut.py times blocks with 1..H heads and 1..d_ff neurons on the target hardware).

CTranslate2 holds one head count per stack and each layer's FFN width, so the table times whole translations of
the model's own pruned copies: the unpruned model; each encoder head count k (every encoder self-attention at k
heads, the rest unpruned) and each decoder head count; every encoder FFN at each width of a grid, and every
decoder FFN. A mask's latency is predicted additively from the unpruned model's: what its encoder and decoder head
counts save, and what each layer's FFN width saves (the stack's saving at that width, interpolated linearly
between grid widths, over its layers). Each curve is made monotone (more units never take less time) and measured
against the median of the five unpruned timings. Translations are forced to a fixed length (the same decoding steps for
every model). The table is kept in `<data_root>/latency/`, keyed by the settings, the model's dimensions, the
CTranslate2 version and the processor, and built once.

The table's additive prediction errs where cuts add up (many heads and neurons at once) and where a whole
translation takes a millisecond, so a search on it is checked by measurement (`calibrated`): the mask found is
timed against the unpruned model and searched again on a target scaled by budget / measured (tighter when it is
slower than the budget, looser when it is well within), then halfway between the targets of the nearest masks
measured on each side; the mask kept is the slowest measured within the budget.
"""
from __future__ import annotations

import hashlib
import json
import logging
import platform
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Sequence

from ..errors import UserError
from ..files import write_json
from .ctranslate2 import import_ctranslate2, model_spec, save, sentences_per_s

log = logging.getLogger(__name__)
WIDTH_STEPS = 8  # FFN widths timed: d_ff · i / 8 for i = 0..8 (width 0 is written as one zero neuron)
TABLE_VERSION = 2  # in the cache key: a table built the way an earlier hprune built it is measured again


@dataclass
class LatencySettings:
    """How latency is measured: CTranslate2's compute type and threads, beam size, how many sentences of which
    split, the length every translation is forced to (None: the sources' mean length), timing rounds, the least
    time one timing lasts (the sentences translated again until then); how many times a latency budget's mask is
    measured and searched again (`calibrated`; 0: the table's prediction alone), and how far below the budget a
    measured mask may lie before a looser one is searched."""
    measure: bool = False
    split: str = "valid"
    compute_type: str = "int8"
    threads: int = 1
    beam: int = 4
    sentences: int = 64
    length: int | None = None
    rounds: int = 3
    min_seconds: float = 0.5
    calibrate: int = 4
    calibrate_tolerance: float = 0.02


@dataclass
class LatencyTable:
    """Seconds per sentence, measured: `unpruned`; {k: s} with every encoder (decoder) self-attention at k heads
    (the decoder's cross-attention too: one count per stack); {width: s} with every encoder (decoder) FFN at width."""
    unpruned: float
    encoder_heads: Dict[int, float]
    decoder_heads: Dict[int, float]
    encoder_ffn: Dict[int, float]
    decoder_ffn: Dict[int, float]
    layers: Dict[str, int]
    key: str = ""

    def ffn_saving(self, stack: str, width: int) -> float:
        """What one layer of `stack` saves with its FFN at `width` (linear between the widths timed)."""
        table = self.encoder_ffn if stack == "encoder" else self.decoder_ffn
        widths = sorted(table)
        width = max(width, widths[0])
        upper = next(w for w in widths if w >= width)
        lower = max(w for w in widths if w <= width)
        at = table[lower] if upper == lower else \
            table[lower] + (table[upper] - table[lower]) * (width - lower) / (upper - lower)
        return (table[widths[-1]] - at) / self.layers[stack]

    def heads_saving(self, stack: str, heads: int) -> float:
        table = self.encoder_heads if stack == "encoder" else self.decoder_heads
        return table[max(table)] - table[heads]

    def predict(self, heads: Dict[str, int], widths: Dict[str, List[int]]) -> float:
        """Seconds per sentence of the model with `heads` per stack and the FFN `widths` per layer of each stack."""
        return self.unpruned - sum(self.heads_saving(stack, k) for stack, k in heads.items()) - sum(
            self.ffn_saving(stack, w) for stack, per_layer in widths.items() for w in per_layer)

    def to_json(self) -> dict:
        return {key: ({str(k): v for k, v in value.items()} if isinstance(value, dict) and key != "layers" else value)
                for key, value in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict) -> "LatencyTable":
        tables = ("encoder_heads", "decoder_heads", "encoder_ffn", "decoder_ffn")
        return cls(**{key: ({int(k): v for k, v in value.items()} if key in tables else value)
                      for key, value in data.items()})


def monotone(points: Dict[int, float]) -> Dict[int, float]:
    """The closest non-decreasing curve in least squares (pool adjacent violators): timing noise would otherwise
    make a unit's removal cost time."""
    blocks: List[List[float]] = []  # [mean, count]
    for key in sorted(points):
        blocks.append([points[key], 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean_a, n_a), (mean_b, n_b) = blocks.pop(-2), blocks.pop()
            blocks.append([(mean_a * n_a + mean_b * n_b) / (n_a + n_b), n_a + n_b])
    values = [mean for mean, count in blocks for _ in range(count)]
    return dict(zip(sorted(points), values))


def dimensions(model) -> dict:
    """What the table depends on in a model: layers, widths, heads, vocabularies."""
    encoder, decoder = model.encoder, model.decoder
    return {"layers": [len(encoder.layers), len(decoder.layers)], "embed_dim": encoder.layers[0].fc1.in_features,
            "head_dim": encoder.layers[0].self_attn.head_dim,
            "heads": [encoder.layers[0].self_attn.total_heads, decoder.layers[0].self_attn.total_heads],
            "ffn": [encoder.layers[0].fc2.total_neurons, decoder.layers[0].fc2.total_neurons],
            "vocabulary": [encoder.embed_tokens.num_embeddings, decoder.embed_tokens.num_embeddings],
            "pre_norm": bool(encoder.layers[0].normalize_before)}


def forced_length(settings: LatencySettings, sources: Sequence[list]) -> int:
    return settings.length or max(1, round(sum(map(len, sources)) / len(sources)))


def measured(models: Dict[str, Callable[[], object]], model_cfg, dictionaries, sources: Sequence[list],
             settings: LatencySettings) -> Dict[str, float]:
    """Seconds per sentence of each model ({name: a function building the hprune model}) written to CTranslate2 and
    timed side by side with the settings (the first `sentences` sources, translations forced to the same length)."""
    sources = list(sources[:settings.sentences])
    length = forced_length(settings, sources)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for name, build in models.items():  # one model in memory at a time
            dirs[name] = str(Path(tmp) / name.replace(" ", "_"))
            Path(dirs[name]).mkdir()
            save(model_spec(build(), model_cfg, *dictionaries), dirs[name], settings.compute_type)
        speed = sentences_per_s(dirs, sources, settings.beam, settings.threads, rounds=settings.rounds,
                                lengths=(length,), min_seconds=settings.min_seconds)[length]
    return {name: 1.0 / value for name, value in speed.items()}


def seconds_per_sentence(session, mask: dict, settings: LatencySettings) -> Dict[str, float]:
    """Seconds per sentence in CTranslate2 of an opened model (hprune.session.Session) under `mask` ("pruned") and
    unpruned ("unpruned"), timed side by side (measured)."""
    return measured({"pruned": lambda: session.pruned_copy(mask),
                     "unpruned": lambda: session.pruned_copy(session.unpruned_mask())},
                    session.model_config, session.dictionaries, session.source_tokens(settings.split), settings)


def table_of(session, settings: LatencySettings, cache: Path) -> LatencyTable:
    """An opened model's latency table (latency_table): measured once, then read from `cache`."""
    return latency_table(session.model, session.pruned_copy_keeping, session.model_config, session.dictionaries,
                         session.source_tokens(settings.split), settings, cache)


def latency_metrics(fraction: float) -> dict:
    """A measured latency, as a fraction of the unpruned model's, as metrics.json keeps it."""
    return {"latency_pct_measured": round(100 * fraction, 2), "latency_speedup": round(1 / fraction, 3)}


def table_key(settings: LatencySettings, model, length: int) -> str:
    ctranslate2 = import_ctranslate2("prune.latency_budget")
    measured_how = {"measure", "split", "calibrate", "calibrate_tolerance"}  # not how the table is timed
    kept = {key: value for key, value in asdict(settings).items() if key not in measured_how}
    what = {"version": TABLE_VERSION, "settings": {**kept, "length": length}, "model": dimensions(model),
            "ctranslate2": ctranslate2.__version__, "processor": _processor()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def latency_table(model, pruned_copy: Callable[[dict], object], model_cfg, dictionaries, sources: Sequence[list],
                  settings: LatencySettings, cache: Path) -> LatencyTable:
    """The model's latency table (module docstring): read from `cache` when it was measured with the same key, else
    measured now and kept there. pruned_copy(ids): the model with only the heads and neurons `ids` names
    ({type: [[ids] per layer]}, as backend.pruned_model)."""
    sources = list(sources[:settings.sentences])
    length = forced_length(settings, sources)
    key = table_key(settings, model, length)
    path = cache / f"{key}.json"
    if path.exists():
        log.info("latency table %s (measured before)", path)
        return LatencyTable.from_json(json.loads(path.read_text()))
    dims = dimensions(model)
    (enc_heads, dec_heads), (enc_ffn, dec_ffn) = dims["heads"], dims["ffn"]
    n_enc, n_dec = dims["layers"]

    def ids(encoder_heads: int, decoder_heads: int, encoder_ffn: int, decoder_ffn: int) -> dict:
        return {"enc-self": [list(range(encoder_heads))] * n_enc, "dec-self": [list(range(decoder_heads))] * n_dec,
                "dec-enc": [list(range(decoder_heads))] * n_dec, "enc-ffn": [list(range(encoder_ffn))] * n_enc,
                "dec-ffn": [list(range(decoder_ffn))] * n_dec}

    # each family with its own unpruned point (the same model, timed in its turn): a saving is measured against
    # the point timed beside it, and the unpruned latency is the median of all of them
    grid = {"unpruned": ids(enc_heads, dec_heads, enc_ffn, dec_ffn)}
    grid.update({f"encoder_heads {k}": ids(k, dec_heads, enc_ffn, dec_ffn) for k in range(1, enc_heads + 1)})
    grid.update({f"decoder_heads {k}": ids(enc_heads, k, enc_ffn, dec_ffn) for k in range(1, dec_heads + 1)})
    widths = {stack: sorted({round(n * i / WIDTH_STEPS) for i in range(WIDTH_STEPS + 1)})
              for stack, n in (("encoder", enc_ffn), ("decoder", dec_ffn))}
    grid.update({f"encoder_ffn {w}": ids(enc_heads, dec_heads, w, dec_ffn) for w in widths["encoder"]})
    grid.update({f"decoder_ffn {w}": ids(enc_heads, dec_heads, enc_ffn, w) for w in widths["decoder"]})
    log.info("measuring the latency table in CTranslate2 (%s, %d thread(s), beam %d, %d sentences x %d tokens): "
             "%d models", settings.compute_type, settings.threads, settings.beam, len(sources), length, len(grid))
    seconds = measured({name: (lambda kept=kept: pruned_copy(kept)) for name, kept in grid.items()}, model_cfg,
                       dictionaries, sources, settings)
    full = statistics.median([seconds["unpruned"], seconds[f"encoder_heads {enc_heads}"],
                              seconds[f"decoder_heads {dec_heads}"], seconds[f"encoder_ffn {enc_ffn}"],
                              seconds[f"decoder_ffn {dec_ffn}"]])

    def family(prefix: str) -> Dict[int, float]:
        """One family's curve: the unpruned point is the median of all five (one slow round of one of them would
        otherwise shift the whole family's savings), and latency may not fall as units are added (pooled)."""
        points = {int(name.split()[1]): value for name, value in seconds.items() if name.startswith(prefix + " ")}
        points[max(points)] = full
        return monotone(points)

    table = LatencyTable(unpruned=full, encoder_heads=family("encoder_heads"), decoder_heads=family("decoder_heads"),
                         encoder_ffn=family("encoder_ffn"), decoder_ffn=family("decoder_ffn"),
                         layers={"encoder": n_enc, "decoder": n_dec}, key=key)
    write_json(path, table.to_json())
    return table


def calibrated(search: Callable[[float], object], measure: Callable[[object, float], float], budget: float,
               rounds: int, tolerance: float = 0.02) -> tuple:
    """A latency budget met in measurement, not only in the table: search(target) finds a mask for a target
    fraction of the unpruned latency as the table predicts it (UserError when the table has none), measure(mask,
    target) times it (a fraction of the unpruned model's latency). Starting at the budget, a secant step while the
    masks measured lie on one side of the budget (the target scaled by budget / measured: tighter for a mask slower
    than the budget, looser for one more than `tolerance` faster), then bisection between the loosest target within
    the budget and the tightest over it; each new target moved on until the search finds a mask not yet measured;
    at most `rounds` measurements. Returns the mask within the budget that measured slowest (else the last one
    measured, or with rounds=0 the table's), the target it was found for, its measured fraction (None with rounds=0)
    and each measurement as {"target", "measured"}."""
    found, target = search(budget), budget
    history, seen = [], []  # seen: (mask, measured fraction)
    within = over = None  # the loosest target whose mask measured within the budget, the tightest over it
    best = None
    while len(history) < rounds:
        fraction = measure(found, target)
        history.append({"target": round(target, 4), "measured": round(fraction, 4)})
        seen.append((found, fraction))
        if fraction <= budget:
            within = max(within or target, target)
            if best is None or fraction > best[2]:
                best = (found, target, fraction)
        else:
            over = min(over or target, target)
        if len(history) == rounds or (fraction <= budget and budget - fraction <= tolerance):
            break
        step = _next_unmeasured(search, seen, budget, target, fraction, within, over)
        if step is None:  # no mask the table can give lies nearer the budget
            break
        target, found = step
    if best is not None:
        return (*best, history)
    return found, target, (history[-1]["measured"] if history else None), history


def _next_unmeasured(search, seen: list, budget: float, target: float, fraction: float, within, over):
    """calibrated's next (target, mask): a mask not measured yet, or None where the search finds none."""
    for _ in range(100):  # the table's masks are discrete: move the target until the search finds another
        if within is not None and over is not None:
            if over - within < 1e-6:
                return None
            target = (within + over) / 2
        else:
            target *= budget / fraction
        try:
            candidate = search(target)
        except UserError:  # the table has no faster mask
            return None
        measured = [f for mask, f in seen if mask == candidate]
        if not measured:
            return target, candidate
        if within is not None and over is not None:
            if measured[0] <= budget:
                within = target
            else:
                over = target
    return None
