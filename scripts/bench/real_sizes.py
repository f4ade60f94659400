"""Every verb at the sizes users bring: the real configurations of transformer_big (fairseq, a 32k joint
vocabulary), OPUS-MT en-de (Marian), mBART-50, NLLB-200-distilled-600M, M2M100 1.2B and NLLB-200 1.3B, built with
random weights (no download; cost does not depend on the weights) and their own kind of tokenizer (a small
sentencepiece or BPE model, the vocabulary padded to the real size with words the text never meets, as fairseq pads
a dictionary). Random weights would translate to the length limit, so every hypothesis is forced to LENGTH tokens.

For each model, each verb in a process of its own (wall time; peak memory: the largest VmHWM of the process and its
children, or their largest resident sum at one poll): the import of the Hugging Face folder; `hprune eval` (beam
4); Michel's importance; Kwon et al.'s pruning with `prune.units=[heads,neurons]` on CALIBRATION sentences (the
default is 2,048: cost per sentence); Voita's gates (VOITA_UPDATES updates on TRAIN sentences: fairseq's train_wall
per update; a model's own settings where the defaults do not fit); the latency table (CTranslate2 int8), its
prediction checked on four masks it did not time; latency budgets (BUDGETS) searched with FFN neurons and met as
measured, or not, or refused below the model's floor; `hprune export` to CTranslate2 with its parity check; and
each verb's counted teraFLOPs (torch.utils.flop_counter: the matrix products, for a GPU's estimate).
NLLB-200 3.3B: the import and its memory only. Results go to --out (results.json, table.md, cost.png); a verb
measured there already is not measured again (an interrupted bench resumes).
`python scripts/bench/real_sizes.py [NAME ...] [--verbs a,b] [--device cuda]`.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BIN = Path(sys.executable).parent
SENTENCES, WORDS, LENGTH, BEAM, CALIBRATION, VOITA_UPDATES, TRAIN = 16, 18, 24, 4, 16, 4, 400
THREADS = int(os.environ.get("HPRUNE_BENCH_THREADS", "2"))

# the Hub's config.json of each (only what differs from the config class's defaults)
MODELS = {
    "transformer_big": dict(family="fairseq", vocab=32000),
    "opus-mt-en-de": dict(family="marian", vocab=58101, config=dict(
        d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8,
        encoder_ffn_dim=2048, decoder_ffn_dim=2048, max_position_embeddings=512, activation_function="swish",
        scale_embedding=True)),
    "mbart-large-50": dict(family="mbart50", vocab=250054, config=dict(
        d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16, decoder_attention_heads=16,
        encoder_ffn_dim=4096, decoder_ffn_dim=4096, max_position_embeddings=1024, activation_function="gelu")),
    "nllb-200-distilled-600M": dict(family="nllb", vocab=256206, config=dict(
        d_model=1024, encoder_layers=12, decoder_layers=12, encoder_ffn_dim=4096, decoder_ffn_dim=4096)),
    "m2m100_1.2B": dict(family="m2m100", vocab=128112, config=dict(
        d_model=1024, encoder_layers=24, decoder_layers=24, encoder_ffn_dim=8192, decoder_ffn_dim=8192),
        voita=["prune.optim.max_tokens=512", "prune.optim.update_freq=2", "prune.optim.checkpoint_activations=true"]),
    "nllb-200-1.3B": dict(family="nllb", vocab=256206, config=dict(
        d_model=1024, encoder_layers=24, decoder_layers=24, encoder_ffn_dim=8192, decoder_ffn_dim=8192),
        # the same 1,024 tokens an update, in two batches, activations recomputed: killed at 22.2 GiB otherwise
        voita=["prune.optim.max_tokens=512", "prune.optim.update_freq=2", "prune.optim.checkpoint_activations=true"]),
    "nllb-200-3.3B": dict(family="nllb", vocab=256206, import_only=True, config=dict(
        d_model=2048, encoder_layers=24, decoder_layers=24, encoder_ffn_dim=8192, decoder_ffn_dim=8192)),
}
VERBS = ("import", "eval", "michel", "fisher", "voita", "latency", "budget", "budget_0.8", "export")
BUDGETS = {"budget": 0.7, "budget_0.8": 0.8}  # the latency budgets searched (CTranslate2 int8): the issue's, and one
# above NLLB-600M's floor at these settings (a budget below the floor is refused in one line: the row says so)


# ---------------------------------------------------------------------------------------------------- the text
def text(lines: int, seed: int) -> list[str]:
    """Sentences of made-up words (Zipf-distributed over 3,000 of 2-4 syllables): a tokenizer splits them as it
    splits a language, and the length in pieces is that of WMT's sentences."""
    rng = random.Random(0)
    syllables = [a + b for a in "bdfgklmnprstvz" for b in ("a", "e", "i", "o", "u", "ai", "ou")]
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(3500)})[:3000]
    weights = [1 / (rank + 1) for rank in range(len(words))]
    rng = random.Random(seed)
    return [" ".join(rng.choices(words, weights, k=WORDS)) for _ in range(lines)]


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------------- building
def padded(tokens: list[str], size: int) -> list[str]:
    return tokens + [f"madeupword{i:06d}" for i in range(size - len(tokens))]


def build_fairseq(folder: Path, spec: dict, corpus: list[str]) -> tuple[Path, None, int]:
    """fairseq's transformer_vaswani_wmt_en_de_big with a joint BPE vocabulary (--share-all-embeddings), laid out
    as fairseq's published tarballs unpack (model.pt with the legacy args, dict.en.txt, dict.de.txt, bpecodes)."""
    import torch
    from fairseq import options, tasks
    from subword_nmt.apply_bpe import BPE
    from subword_nmt.learn_bpe import learn_bpe
    folder.mkdir(parents=True)
    with open(folder / "bpecodes", "w") as out:
        learn_bpe(corpus, out, 4000)
    with open(folder / "bpecodes") as f:
        bpe = BPE(f)
    counts: dict[str, int] = {}
    for line in corpus:
        for piece in bpe.segment(line).split():
            counts[piece] = counts.get(piece, 0) + 1
    pieces = padded(sorted(counts, key=counts.get, reverse=True), spec["vocab"] - 4)
    for lang in ("en", "de"):
        write(folder / f"dict.{lang}.txt", [f"{p} {len(pieces) - i}" for i, p in enumerate(pieces)])
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(folder), "--task", "translation", "-s", "en", "-t", "de",
                                                "--arch", "transformer_vaswani_wmt_en_de_big",
                                                "--share-all-embeddings"])
    task = tasks.setup_task(args)
    torch.manual_seed(0)
    model = task.build_model(args)
    args.data = ""  # as published: no path of the machine it was trained on
    history = [{"criterion_name": "LabelSmoothedCrossEntropyCriterion", "optimizer_name": "FairseqAdam",
                "lr_scheduler_state": {"best": None}, "num_updates": 0}]  # as the published checkpoints hold
    torch.save({"args": args, "model": model.state_dict(), "extra_state": {}, "optimizer_history": history},
               folder / "model.pt")
    return folder / "model.pt", None, sum(p.numel() for p in model.parameters())


def build_hf(folder: Path, spec: dict, corpus: list[str]) -> tuple[Path, tuple[str, str] | None, int]:
    """A Hugging Face folder as save_pretrained writes it, from transformers' config class with the real
    dimensions, its tokenizer files of the family's own kind (tests/hf_models.py), random weights; and the language
    pair to translate (a multilingual model), and its parameters (the shared embeddings once)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    import hf_models
    root = folder.parent / f"{folder.name}-tokenizer"
    root.mkdir(parents=True)
    built = hf_models.BUILDERS[spec["family"]](root, {"en": corpus, "fr": corpus}, size=spec["config"],
                                               vocab_size=spec["vocab"])
    shutil.move(str(built["dir"]), folder)
    shutil.rmtree(root)
    return folder, built.get("languages"), built["model"].num_parameters()


# ---------------------------------------------------------------------------------------------------- measuring
def memory_kib(pid: int) -> tuple[int, int]:
    """(VmHWM, VmRSS) of a process, zeros when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        return tuple(int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) for key in ("VmHWM", "VmRSS"))
    except (OSError, AttributeError):
        return 0, 0


def descendants(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return children + [d for c in children for d in descendants(c)]


def measured(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    """Run cmd; its wall time and peak memory: the largest VmHWM among it and its descendants, or the largest
    sum of their resident memory at one poll where several processes hold memory at once (polled every 0.2 s;
    VmHWM is a process's own peak, so a poll misses only a process that lives less than 0.2 s)."""
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})
    peaks: dict[int, int] = {}
    together = [0]

    def poll() -> None:
        while proc.poll() is None:
            resident = 0
            for pid in [proc.pid] + descendants(proc.pid):
                peak, now = memory_kib(pid)
                peaks[pid] = max(peaks.get(pid, 0), peak)
                resident += now
            together[0] = max(together[0], resident)
            time.sleep(0.2)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    proc.wait()
    watcher.join()
    seconds = time.perf_counter() - started
    peaks[-1] = together[0]
    if proc.returncode != 0:
        tail = log.read_text()[-2500:]
        return {"failed": f"exit {proc.returncode}", "seconds": seconds, "peak_gib": max(peaks.values(), default=0) / 2**20,
                "tail": tail}
    return {"seconds": seconds, "peak_gib": max(peaks.values(), default=0) / 2**20}


# what the library measures in a process of its own (the API: the same code as the CLI's verbs)
LIBRARY = r"""
import json, os, sys, time
import hprune
from hprune.flops import flops_written_to
spec = json.loads(sys.argv[1])
started = time.perf_counter()
model = hprune.open(spec["ckpt"], **spec["open"])
opened = time.perf_counter() - started
started = time.perf_counter()
with flops_written_to(os.environ["HPRUNE_FLOPS_TO"]):
    if spec["verb"] == "michel":
        model.scores("michel")
    elif spec["verb"] == "latency":
        from pathlib import Path
        from hprune.deploy.latency import LatencySettings, seconds_per_sentence, table_of
        from hprune.methods.fisher import predicted_latency
        settings = LatencySettings(**spec["latency"])
        table = table_of(model.session, settings, Path(spec["cache"]))
        built = time.perf_counter() - started
        checks = []
        for heads, widths in spec["checks"]:  # masks the table did not time: each stack's heads, FFN widths
            mask = {}
            for attn_type, layer, module in model.session.model.attention_modules():
                k = heads[attn_type.startswith("dec")]
                mask.setdefault(attn_type, []).append([1] * k + [0] * (len(module.head_ids) - k))
            for ffn_type, layer, block in model.session.model.ffn_layers():
                w = widths[ffn_type.startswith("dec")]
                mask.setdefault(ffn_type, []).append([1] * w + [0] * (len(block.fc2.neuron_ids) - w))
            timing = seconds_per_sentence(model.session, mask, settings)
            checks.append({"heads": heads, "ffn": widths, "measured": timing["pruned"] / timing["unpruned"],
                           "predicted": predicted_latency(table, model.session.model, mask)})
            print(json.dumps(checks[-1]), flush=True)
print(json.dumps({"open_s": opened, "verb_s": time.perf_counter() - started,
                  **({"table_s": built, "interaction": table.interaction, "joint": table.joint,
                      "shares": table.shares(), "checks": checks} if spec["verb"] == "latency" else {})}))
"""


def settings(data: Path, languages: tuple[str, str] | None, device: str, fairseq: bool = False) -> dict:
    sets = {"src": str(data / "src.txt"), "tgt": str(data / "tgt.txt")}
    train = {"src": str(data / "train.src.txt"), "tgt": str(data / "train.tgt.txt")}  # Voita's updates: no epoch ends
    pair = {"data.src_lang": languages[0], "data.tgt_lang": languages[1]} if languages else {}
    kind = {"data": "pretrained"} if fairseq else {}  # a published fairseq model's folder (an HF one implies it)
    return {**kind, "device": device, **pair, "data.test_sets": [sets], "data.valid_sets": [sets], "data.train_sets": [train],
            "generation.beam": BEAM, "generation.max_len_a": 0, "generation.max_len_b": LENGTH,
            "generation.min_len": LENGTH, "generation.batch_size": SENTENCES}


def overrides(values: dict) -> list[str]:
    def hydra(value) -> str:
        if isinstance(value, list):
            return "[" + ",".join(hydra(v) for v in value) + "]"
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}:{hydra(v)}" for k, v in value.items()) + "}"
        return str(value)
    return [f"{key}={hydra(value)}" for key, value in values.items()]


def checks(spec: dict) -> list:
    """Masks the latency table does not time, its prediction checked on them: [[encoder, decoder heads], [encoder,
    decoder FFN width]], the deep cuts included."""
    config = spec.get("config", {})
    heads, n = config.get("encoder_attention_heads", 16), config.get("encoder_ffn_dim", 4096)
    return [[[heads // 2] * 2, [3 * n // 4] * 2], [[3 * heads // 4, heads // 4], [n // 4, n // 2]],
            [[2, 2], [3 * n // 8] * 2], [[1, 1], [n // 8] * 2]]


def run_verbs(name: str, spec: dict, ckpt: Path, languages, data: Path, work: Path, verbs: list[str],
              device: str, keep) -> None:
    """Each verb measured in a process of its own, its row given to keep(verb, row) as soon as it ends."""
    common = settings(data, languages, device, spec["family"] == "fairseq")
    env = {"HPRUNE_DATA_ROOT": str(work / "data-bin"), "OMP_NUM_THREADS": str(THREADS)}
    cli = [str(BIN / "hprune")]
    base = [f"ckpt={ckpt}", *overrides(common)]
    latency = dict(compute_type="int8", device=device, threads=THREADS, beam=BEAM, sentences=SENTENCES, length=LENGTH)
    for verb in verbs:
        out = work / "runs" / verb
        log = work / f"{verb}.log"
        if verb == "import":
            continue
        if verb == "eval":
            cmd = cli + ["eval", *base, f"hydra.run.dir={out}"]
        elif verb == "fisher":
            cmd = cli + ["prune", "--method", "fisher", *base, "prune.units=[heads,neurons]",
                         f"prune.calibration.sentences={CALIBRATION}", "prune.calibration.batch_size=8",
                         f"hydra.run.dir={out}"]
        elif verb == "voita":
            cmd = cli + ["prune", "--method", "voita", *base, f"prune.optim.max_update={VOITA_UPDATES}",
                         "prune.optim.log_interval=1", f"hydra.run.dir={out}",
                         *spec.get("voita", ["prune.optim.max_tokens=1024"])]
        elif verb in BUDGETS:
            cmd = cli + ["prune", "--method", "fisher", *base, "prune.units=[heads,neurons]", "prune.layout=per_stack",
                         f"prune.latency_budget={BUDGETS[verb]}", f"prune.calibration.sentences={CALIBRATION}",
                         "prune.calibration.batch_size=8", *overrides({f"latency.{k}": v for k, v in latency.items()}),
                         f"hydra.run.dir={out}"]
        elif verb == "export":
            cmd = cli + ["export", *base, f"threads={THREADS}", f"hydra.run.dir={out}"]
        else:  # michel, latency: through the library
            spec_json = {"ckpt": str(ckpt), "open": common, "verb": verb, "latency": latency,
                         "cache": str(work / "data-bin" / "latency"), "checks": checks(spec)}
            cmd = [sys.executable, "-c", LIBRARY, json.dumps(spec_json)]
        flops = work / f"{verb}.flops.json"
        row = measured(cmd, log, {**env, "HPRUNE_FLOPS_TO": str(flops)})
        for verb_log in sorted(out.glob("*.log")) if "failed" in row else ():  # the run's own log: fairseq's lines
            row["tail"] += f"\n--- {verb_log.name}:\n" + verb_log.read_text()[-2500:]
        refusal = re.search(r"error: (no mask meets this latency budget.*)", row.get("tail", ""))
        if refusal:  # a budget below the model's floor: refused in one line, as it should be
            row = {"seconds": row["seconds"], "peak_gib": row["peak_gib"], "refused": refusal.group(1)}
        if flops.exists():
            row["tflop"] = round(json.loads(flops.read_text())["flops"] / 1e12, 2)
        if "failed" not in row and "refused" not in row:
            row.update(details(verb, out, log))
        keep(verb, row)
        print(f"    {name:<24} {verb:<8} {describe(row)}", flush=True)


def details(verb: str, out: Path, log: Path) -> dict:
    if verb in ("michel", "latency"):
        return json.loads(log.read_text().strip().splitlines()[-1])
    metrics = json.loads((out / "metrics.json").read_text())
    if verb == "voita":  # fairseq's train_wall of each logged update after the first (one a line: log_interval 1)
        inner = re.findall(r"\[train_inner\].*?wpb=([\d.]+).*?train_wall=(\d+)", (out / "prune.log").read_text())
        metrics["seconds_per_update"] = sorted(float(wall) for _, wall in inner[1:])[len(inner[1:]) // 2] \
            if len(inner) > 1 else None
        metrics["tokens_per_update"] = float(inner[-1][0]) if inner else None
    keep = {k: v for k, v in metrics.items() if k.startswith(("seconds", "latency_")) or k in
            ("bleu", "sentences_per_s", "translations_differ", "parity_max_log_prob_diff", "speedup_ctranslate2",
             "num_updates", "kept_heads", "kept_neurons", "tokens_per_update")}
    return keep


def describe(row: dict) -> str:
    if "failed" in row:
        return f"FAILED ({row['failed']}) after {row['seconds']:.0f} s at {row['peak_gib']:.1f} GiB:\n{row['tail']}"
    if "refused" in row:
        return f"{row['seconds']:8.1f} s  {row['peak_gib']:6.2f} GiB  refused: {row['refused']}"
    extra = {k: v for k, v in row.items() if k not in ("seconds", "peak_gib")}
    return f"{row['seconds']:8.1f} s  {row['peak_gib']:6.2f} GiB  {json.dumps(extra)}"


def table(results: dict) -> str:
    """Markdown: each model's parameters, then each verb's wall time, peak memory and counted teraFLOPs."""
    verbs = [v for v in VERBS if any(v in rows for rows in results.values())]
    lines = ["| model | parameters | " + " | ".join(verbs) + " |", "| --- | ---: |" + " ---: |" * len(verbs)]
    for name, rows in results.items():
        cells = []
        for verb in verbs:
            row = rows.get(verb)
            if row is None:
                cells.append("")
            elif "failed" in row:
                cells.append(f"failed at {row['peak_gib']:.1f} GiB")
            elif "refused" in row:
                floor = re.search(r"at least ([\d.]+)", row["refused"])
                cells.append(f"refused: below the floor ({floor.group(1) if floor else '?'})")
            else:
                flop = f", {row['tflop']:g} TFLOP" if row.get("tflop") else ""
                cells.append(f"{row['seconds']:.0f} s, {row['peak_gib']:.1f} GiB{flop}")
        lines.append(f"| {name} | {rows['parameters'] / 1e6:.0f} M | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """Wall time and peak memory of each verb against the model's parameters (log-log)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for verb in VERBS:
        points = sorted((rows["parameters"] / 1e6, rows[verb]["seconds"], rows[verb]["peak_gib"])
                        for rows in results.values() if "failed" not in rows.get(verb, {"failed": 1}))
        if points:
            params, seconds, memory = zip(*points)
            left.plot(params, seconds, "o-", label=verb)
            right.plot(params, memory, "o-", label=verb)
    for axis, label in ((left, "wall time (s)"), (right, "peak memory, VmHWM (GiB)")):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("parameters (millions)")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
    right.axhline(24, color="grey", linestyle="--", linewidth=1)
    left.legend(fontsize=8)
    figure.suptitle(f"every verb at real sizes: {SENTENCES} sentences, beam {BEAM}, {THREADS} CPU threads")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", default=list(MODELS))
    parser.add_argument("--verbs", default=",".join(VERBS))
    parser.add_argument("--keep", help="build the models here and keep them (else a temporary folder)")
    parser.add_argument("--out", default="outputs/bench/real_sizes",
                        help="results.json (written after each verb), table.md and cost.png; a verb measured there "
                             "already is not measured again (an interrupted bench resumes)")
    parser.add_argument("--again", action="store_true", help="measure the models named even when out holds them")
    parser.add_argument("--device", default="cpu", help="cuda: hprune's verbs and CTranslate2's latency on the GPU")
    args = parser.parse_args()
    verbs = args.verbs.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "results.json"
    results = json.loads(saved.read_text()) if saved.exists() else {}
    corpus = text(4000, seed=1)
    test, train = text(SENTENCES, seed=2), text(TRAIN, seed=3)
    print(f"  {SENTENCES} sentences of {WORDS} words, hypotheses forced to {LENGTH} tokens, beam {BEAM}, "
          f"{THREADS} threads; fisher on {CALIBRATION} calibration sentences; Voita {VOITA_UPDATES} updates")
    for name in args.names:
        spec = MODELS[name]
        done = {} if args.again else results.get(name, {})
        todo = [v for v in verbs if v != "import" and not spec.get("import_only")
                and "failed" in done.get(v, {"failed": 1})]
        if spec["family"] != "fairseq" and (todo or "failed" in done.get("import", {"failed": 1})):
            todo.insert(0, "import")  # (the verbs after it read the imported model: not measured importing it)
        if not todo:
            print(f"  {name}: measured before ({saved})", flush=True)
            continue
        with tempfile.TemporaryDirectory(dir=args.keep) as tmp:
            work = Path(tmp)
            data = work / "text"
            data.mkdir()
            write(data / "src.txt", test)
            write(data / "tgt.txt", test)
            write(data / "train.src.txt", train)
            write(data / "train.tgt.txt", train)
            started = time.perf_counter()
            builder = build_fairseq if spec["family"] == "fairseq" else build_hf
            try:
                source, languages, parameters = builder(work / name, spec, corpus)
            except Exception as err:  # one model that cannot be built: said, and the others measured
                print(f"  {name}: NOT BUILT ({type(err).__name__}: {err})", flush=True)
                continue
            print(f"  {name}: {parameters / 1e6:.0f} M parameters, built in {time.perf_counter() - started:.0f} s",
                  flush=True)
            results[name] = rows = {**done, "parameters": parameters}

            def keep(verb: str, row: dict) -> None:  # saved verb by verb: a bench stopped midway keeps what it measured
                rows[verb] = row
                saved.write_text(json.dumps(results, indent=1, default=str))
            if "import" in todo:
                code = ("import sys; from pathlib import Path; from hprune.backend import import_hf; "
                        "import_hf(Path(sys.argv[1]), Path(sys.argv[2]))")
                keep("import", measured([sys.executable, "-c", code, str(source), str(work / "data-bin" / "models")],
                                        work / "import.log"))
                print(f"    {name:<24} {'import':<8} {describe(rows['import'])}", flush=True)
            if not spec.get("import_only"):
                run_verbs(name, spec, source, languages, data, work, todo, args.device, keep)
    (out / "table.md").write_text(table(results) + "\n")
    plot(results, out / "cost.png")
    print(table(results))
    print(f"  {saved}, {out / 'table.md'}, {out / 'cost.png'}")


if __name__ == "__main__":
    main()
