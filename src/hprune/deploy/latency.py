"""A latency table of a model in CTranslate2, measured on this machine (Kwon et al.'s latency constraint: their
generate_lut.py times blocks with 1..H heads and 1..d_ff neurons on the target hardware).

CTranslate2 holds one head count per stack and each layer's FFN width, so the table times whole translations of
the model's own pruned copies, each beside the unpruned model (loaded once, timed alternately with it: a point's
latency is its ratio to the unpruned timing next to it, so the machine's drift cancels, and no more than two models
are in memory). Four families of points: each stack's head count at 1, 2, H/4, H/2, 3H/4 (every self-attention of
the stack at k heads, the decoder's cross-attention too: one count per stack; the rest unpruned), and each stack's
FFNs all at 0, ¼, ½, ¾ of d_ff; between points a curve is linear, and it is made monotone (more units never take
less time). Then two joint points, every family cut at once (H/4 heads and d_ff/4, H/2 and d_ff/2), to which the
interaction of the savings is fitted: a mask's latency, as a fraction of the unpruned model's, is

    1 − Σ_f s_f + γ Σ_{f<g} s_f s_g

where s_f is what family f's cut saves alone (its heads, or each layer's FFN width: the stack's saving at that
width over its layers) and γ the least-squares fit on the joint points (cuts save less together than apart where
the machine overlaps their work: γ > 0; γ = 1 is the product of the families' fractions). Translations are forced
to a fixed length (the same decoding steps for every model). The table is kept in `<data_root>/latency/`, keyed by
the settings, the model's dimensions, the CTranslate2 version and the processor, and built once.

A search on the table is checked by measurement (`calibrated`): the mask found is timed against the unpruned
model and searched again on a target scaled by budget / measured (tighter when it is slower than the budget, looser
when it is well within), then halfway between the targets of the nearest masks measured on each side; the mask kept
is the slowest measured within the budget.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import platform
import shutil
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import UserError
from ..files import write_json
from .ctranslate2 import forced, import_ctranslate2, model_spec, save, sentences_per_s, timed_sentences_per_s

log = logging.getLogger(__name__)
WIDTH_STEPS = 4  # FFN widths timed: d_ff · i / 4 for i = 0..4 (width 0 is written as one zero neuron)
JOINT = (4, 2)  # the joint points: every stack at H/j heads and d_ff/j neurons
TABLE_VERSION = 3  # in the cache key: a table built the way an earlier hprune built it is measured again
FAMILIES = ("encoder_heads", "decoder_heads", "encoder_ffn", "decoder_ffn")


@dataclass
class LatencySettings:
    """How latency is measured: CTranslate2's compute type, device and threads, beam size, how many sentences of which
    split, the length every translation is forced to (None: the sources' mean length), timing rounds, the least
    time one timing lasts (the sentences translated again until then); how many times a latency budget's mask is
    measured and searched again (`calibrated`; 0: the table's prediction alone), and how far below the budget a
    measured mask may lie before a looser one is searched."""
    measure: bool = False
    split: str = "valid"
    compute_type: str = "int8"
    device: str = "cpu"
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
    (the decoder's cross-attention too: one count per stack); {width: s} with every encoder (decoder) FFN at width;
    the savings' `interaction` γ (module docstring), fitted on the `joint` points ({name: {"heads": [encoder,
    decoder], "ffn": [encoder, decoder], "seconds": measured, "additive": the prediction without γ}})."""
    unpruned: float
    encoder_heads: Dict[int, float]
    decoder_heads: Dict[int, float]
    encoder_ffn: Dict[int, float]
    decoder_ffn: Dict[int, float]
    layers: Dict[str, int]
    key: str = ""
    interaction: float = 0.0
    joint: Dict[str, dict] = field(default_factory=dict)
    ratios: Dict[str, float] = field(default_factory=dict)  # each point as timed: over the unpruned beside it

    def ffn_saving(self, stack: str, width: int) -> float:
        """What one layer of `stack` saves with its FFN at `width` (linear between the widths timed)."""
        table = self.encoder_ffn if stack == "encoder" else self.decoder_ffn
        return (table[max(table)] - interpolated(table, width)) / self.layers[stack]

    def heads_saving(self, stack: str, heads: int) -> float:
        table = self.encoder_heads if stack == "encoder" else self.decoder_heads
        return table[max(table)] - interpolated(table, heads)

    def savings(self, heads: Dict[str, int], widths: Dict[str, List[int]]) -> Dict[str, float]:
        """What each family's cut saves alone, in seconds per sentence ({family: s}; a stack not named: unpruned)."""
        return {**{f"{stack}_heads": self.heads_saving(stack, k) for stack, k in heads.items()},
                **{f"{stack}_ffn": sum(self.ffn_saving(stack, w) for w in per_layer)
                   for stack, per_layer in widths.items()}}

    def latency(self, savings: Dict[str, float]) -> float:
        """Seconds per sentence with the families' savings (savings()): their sum, less the interaction."""
        pairs = sum(a * b for a, b in itertools.combinations(savings.values(), 2))
        return self.unpruned - sum(savings.values()) + self.interaction * pairs / self.unpruned

    def predict(self, heads: Dict[str, int], widths: Dict[str, List[int]]) -> float:
        """Seconds per sentence of the model with `heads` per stack and the FFN `widths` per layer of each stack."""
        return self.latency(self.savings(heads, widths))

    def shares(self) -> Dict[str, float]:
        """The fraction of the unpruned latency that the heads (all but one per stack) and the FFNs (every neuron)
        hold, as the families measured alone."""
        return {"heads": sum(self.heads_saving(stack, 1) for stack in self.layers) / self.unpruned,
                "ffn": sum(self.ffn_saving(stack, 0) * self.layers[stack] for stack in self.layers) / self.unpruned}

    def to_json(self) -> dict:
        return {key: ({str(k): v for k, v in value.items()} if key in FAMILIES else value)
                for key, value in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict) -> "LatencyTable":
        return cls(**{key: ({int(k): v for k, v in value.items()} if key in FAMILIES else value)
                      for key, value in data.items()})


def interpolated(curve: Dict[int, float], x: float) -> float:
    """A curve's value at x, linear between its points (clamped to its ends)."""
    keys = sorted(curve)
    x = min(max(x, keys[0]), keys[-1])
    upper = next(k for k in keys if k >= x)
    lower = max(k for k in keys if k <= x)
    if upper == lower:
        return curve[lower]
    return curve[lower] + (curve[upper] - curve[lower]) * (x - lower) / (upper - lower)


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
             settings: LatencySettings, rounds: Optional[dict] = None) -> Dict[str, float]:
    """Seconds per sentence of each model ({name: a function building the hprune model}) written to CTranslate2 and
    timed side by side with the settings (the first `sentences` sources, translations forced to the same length),
    the best round of each; `rounds` gets every round's ({name: [seconds per sentence]})."""
    sources = list(sources[:settings.sentences])
    length = forced_length(settings, sources)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for name, build in models.items():  # one model in memory at a time
            dirs[name] = str(Path(tmp) / name.replace(" ", "_"))
            Path(dirs[name]).mkdir()
            save(model_spec(build(), model_cfg, *dictionaries), dirs[name], settings.compute_type)
        every: dict = {}
        speed = sentences_per_s(dirs, sources, settings.beam, settings.threads, rounds=settings.rounds,
                                device=settings.device, lengths=(length,), min_seconds=settings.min_seconds,
                                every=every)[length]
    if rounds is not None:
        rounds.update({name: [1.0 / value for value in values] for name, values in every[length].items()})
    return {name: 1.0 / value for name, value in speed.items()}


def seconds_per_sentence(session, mask: dict, settings: LatencySettings) -> Dict[str, object]:
    """Seconds per sentence in CTranslate2 of an opened model (hprune.session.Session) under `mask` ("pruned") and
    unpruned ("unpruned"), timed side by side (measured), and each round's pruned / unpruned ratio ("ratios": the
    rounds alternate the two models, so a round's ratio is one measurement of the fraction)."""
    rounds: dict = {}
    seconds = measured({"pruned": lambda: session.pruned_copy(mask),
                        "unpruned": lambda: session.pruned_copy(session.unpruned_mask())},
                       session.model_config, session.dictionaries, session.source_tokens(settings.split), settings,
                       rounds)
    return {**seconds, "ratios": [p / u for p, u in zip(rounds["pruned"], rounds["unpruned"])]}


def table_of(session, settings: LatencySettings, cache: Path) -> LatencyTable:
    """An opened model's latency table (latency_table): measured once, then read from `cache`."""
    return latency_table(session.model, session.pruned_copy_keeping, session.model_config, session.dictionaries,
                         session.source_tokens(settings.split), settings, cache)


def latency_metrics(fraction: float, ratios: Sequence[float] = ()) -> dict:
    """A measured latency, as a fraction of the unpruned model's, as metrics.json keeps it; with the rounds'
    ratios, their range (`latency_pct_low`, `latency_pct_high`): the timing noise, within which two latencies are
    not told apart."""
    found = {"latency_pct_measured": round(100 * fraction, 2), "latency_speedup": round(1 / fraction, 3)}
    if ratios:
        found.update(latency_pct_low=round(100 * min(ratios), 2), latency_pct_high=round(100 * max(ratios), 2))
    return found


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


def head_counts(heads: int) -> List[int]:
    """The head counts a stack is timed at: 1, 2, H/4, H/2, 3H/4 and H."""
    return sorted({k for k in (1, 2, heads // 4, heads // 2, 3 * heads // 4, heads) if 1 <= k <= heads})


def ffn_widths_timed(neurons: int) -> List[int]:
    return sorted({round(neurons * i / WIDTH_STEPS) for i in range(WIDTH_STEPS + 1)})


def table_points(dims: dict) -> Dict[str, Tuple[int, int, int, int]]:
    """The points the table times besides the unpruned model: {name: (encoder heads, decoder heads, encoder FFN
    width, decoder FFN width)}."""
    (enc_heads, dec_heads), (enc_ffn, dec_ffn) = dims["heads"], dims["ffn"]
    points = {}
    points.update({f"encoder_heads {k}": (k, dec_heads, enc_ffn, dec_ffn) for k in head_counts(enc_heads)[:-1]})
    points.update({f"decoder_heads {k}": (enc_heads, k, enc_ffn, dec_ffn) for k in head_counts(dec_heads)[:-1]})
    points.update({f"encoder_ffn {w}": (enc_heads, dec_heads, w, dec_ffn) for w in ffn_widths_timed(enc_ffn)[:-1]})
    points.update({f"decoder_ffn {w}": (enc_heads, dec_heads, enc_ffn, w) for w in ffn_widths_timed(dec_ffn)[:-1]})
    points.update({f"joint {j}": (max(1, enc_heads // j), max(1, dec_heads // j), enc_ffn // j, dec_ffn // j)
                   for j in JOINT})
    return points


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
    n_enc, n_dec = dims["layers"]

    def kept(encoder_heads: int, decoder_heads: int, encoder_ffn: int, decoder_ffn: int) -> Callable[[], object]:
        ids = {"enc-self": [list(range(encoder_heads))] * n_enc, "dec-self": [list(range(decoder_heads))] * n_dec,
               "dec-enc": [list(range(decoder_heads))] * n_dec, "enc-ffn": [list(range(encoder_ffn))] * n_enc,
               "dec-ffn": [list(range(decoder_ffn))] * n_dec}
        return lambda: pruned_copy(ids)

    points = table_points(dims)
    log.info("measuring the latency table in CTranslate2 (%s, %d thread(s), beam %d, %d sentences x %d tokens): "
             "%d models, each beside the unpruned one", settings.compute_type, settings.threads, settings.beam,
             len(sources), length, len(points))
    unpruned_build = kept(*dims["heads"], *dims["ffn"])
    ratios, references = ratios_to_unpruned(unpruned_build, {name: kept(*at) for name, at in points.items()},
                                            model_cfg, dictionaries, sources, length, settings)
    full = statistics.median(references)
    seconds = {name: full * ratio for name, ratio in ratios.items()}

    def family(prefix: str) -> Dict[int, float]:
        """One family's curve, ending at the unpruned latency; latency may not fall as units are added (pooled),
        nor exceed the unpruned model's."""
        curve = monotone({int(name.split()[1]): value for name, value in seconds.items()
                          if name.startswith(prefix + " ")})
        top = {"encoder_heads": dims["heads"][0], "decoder_heads": dims["heads"][1], "encoder_ffn": dims["ffn"][0],
               "decoder_ffn": dims["ffn"][1]}[prefix]
        return {**{k: min(v, full) for k, v in curve.items()}, top: full}

    table = LatencyTable(full, *(family(prefix) for prefix in FAMILIES), layers={"encoder": n_enc, "decoder": n_dec},
                         key=key, ratios={name: round(ratio, 4) for name, ratio in ratios.items()})
    table.joint = {name: {"heads": list(points[name][:2]), "ffn": list(points[name][2:]), "seconds": seconds[name],
                          "additive": table.predict(*joint_mask(points[name], n_enc, n_dec))}
                   for name in points if name.startswith("joint ")}
    table.interaction = interaction(table, n_enc, n_dec)
    write_json(path, table.to_json())
    return table


def joint_mask(point: Tuple[int, int, int, int], n_enc: int, n_dec: int) -> Tuple[Dict[str, int], Dict[str, list]]:
    """A point as predict()'s arguments: the heads per stack, every layer's FFN width."""
    return ({"encoder": point[0], "decoder": point[1]}, {"encoder": [point[2]] * n_enc, "decoder": [point[3]] * n_dec})


def interaction(table: LatencyTable, n_enc: int, n_dec: int) -> float:
    """γ, the least-squares fit of `measured = additive + γ Σ_{f<g} s_f s_g / unpruned` on the joint points."""
    num = den = 0.0
    for point in table.joint.values():
        savings = table.savings(*joint_mask((*point["heads"], *point["ffn"]), n_enc, n_dec))
        pairs = sum(a * b for a, b in itertools.combinations(savings.values(), 2)) / table.unpruned
        num += pairs * (point["seconds"] - point["additive"])
        den += pairs * pairs
    # within [-1, 1]: each join then still takes time (the search bisects on it), whatever the timings' noise
    return max(-1.0, min(1.0, num / den)) if den > 0 else 0.0


def ratios_to_unpruned(unpruned: Callable[[], object], points: Dict[str, Callable[[], object]], model_cfg,
                       dictionaries, sources: List[list], length: int,
                       settings: LatencySettings) -> Tuple[Dict[str, float], List[float]]:
    """Each point's seconds per sentence over the unpruned model's, timed alternately with it (`rounds` each, the
    best of each side): {name: ratio}, and the unpruned model's seconds per sentence beside each point. Two models
    in memory at most: the unpruned one, loaded once, and the point's, written, timed and removed in its turn."""
    ctranslate2 = import_ctranslate2("prune.latency_budget")
    fixed = forced(length, length, None, len(sources))

    def timing(translator) -> float:
        return 1.0 / timed_sentences_per_s(translator, sources, settings.beam, fixed, settings.min_seconds)

    with tempfile.TemporaryDirectory() as tmp:
        def loaded(name: str, build: Callable[[], object]):
            folder = Path(tmp) / name.replace(" ", "_")
            folder.mkdir()
            save(model_spec(build(), model_cfg, *dictionaries), folder, settings.compute_type)
            translator = ctranslate2.Translator(str(folder), device=settings.device, intra_threads=settings.threads)
            translator.translate_batch(sources[:8], beam_size=settings.beam, **forced(length, length, None, 8))
            return folder, translator

        _, reference = loaded("unpruned", unpruned)
        ratios, references = {}, []
        for done, (name, build) in enumerate(points.items(), 1):
            folder, translator = loaded(name, build)
            best_reference, best = zip(*[(timing(reference), timing(translator)) for _ in range(settings.rounds)])
            ratios[name] = min(best) / min(best_reference)
            references.append(min(best_reference))
            del translator
            shutil.rmtree(folder)
            log.info("latency table: %d/%d %s at %.3f of the unpruned latency", done, len(points), name, ratios[name])
    return ratios, references


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
