"""`hprune eval ckpt=PATH`: beam search on a split; sacreBLEU BLEU and chrF on detokenized text."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from ..data.prepare import prepare, test_set_of
from ..errors import UserError
from ..files import git_sha, run_dir, write_atomic, write_json
from ..pruning.heads import kept_columns, mask_without
from . import hydra_app

EVAL_MAX_TOKENS = 4096  # teacher-forced batches for the MAC count and the expert load


def resolve_checkpoint(ckpt: str) -> Path:
    """A .pt file as given; for a train run dir (or its checkpoints/), the averaged checkpoint when the run made one
    (train.average_last), else checkpoint_best.pt."""
    path = Path(ckpt).expanduser()
    if not path.is_dir():
        return path
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    return next((folder / name for name in ("checkpoint_averaged.pt", "checkpoint_best.pt")
                 if (folder / name).exists()), folder / "checkpoint_best.pt")


def read_references(raw_file: Path, n: int) -> list[str]:
    if not raw_file.exists():
        raise UserError(f"references {raw_file} are missing; run `hprune data prepare` again")
    refs = raw_file.read_text().splitlines()
    if len(refs) != n:
        raise UserError(f"{raw_file} has {len(refs)} lines but the binarized split has {n}; "
                        "delete the data folder and prepare it again")
    return refs


def score(hypotheses: list[str], references: list[str]) -> dict:
    from sacrebleu.metrics import BLEU, CHRF

    bleu, chrf = BLEU(), CHRF()
    return {"bleu": round(bleu.corpus_score(hypotheses, [references]).score, 4),
            "bleu_signature": str(bleu.get_signature()),
            "chrf": round(chrf.corpus_score(hypotheses, [references]).score, 4),
            "chrf_signature": str(chrf.get_signature())}


def translate_and_score(cfg: DictConfig, loaded, data_bin: Path):
    """Beam search on cfg.split with cfg.generation, scored against the split's raw references:
    (backend.Translations, {bleu, chrf and their signatures})."""
    from .. import backend

    result = backend.translate(loaded, cfg.generation, cfg.split, cfg.seed, cfg.data.post_process,
                               cfg.data.tokenizer)
    references = read_references(data_bin.parent / "raw" / f"{cfg.split}.{cfg.data.tgt_lang}", result.sentences)
    return result, score(result.hypotheses, references)


def model_costs(loaded, split: str, out: Path) -> dict:
    """Parameters, counted MACs per target token (whole model and attention), and on MoA models the MoA
    settings and how evenly the experts are used (expert_load.csv in the run dir)."""
    from .. import backend
    from ..analysis.moa import expert_load, load_summary
    from ..flops import macs_per_token

    costs = {"n_params": backend.count_parameters(loaded.model),
             **macs_per_token(loaded.model, next(backend.batches(loaded, split, EVAL_MAX_TOKENS, 1)))}
    load = expert_load(loaded.model, backend.batches(loaded, split, EVAL_MAX_TOKENS))
    if not load.empty:
        model_cfg = loaded.cfg.model
        costs.update(moa_experts=model_cfg.moa_experts, moa_top_k=model_cfg.moa_top_k,
                     moa_head_dim=model_cfg.moa_head_dim, moa_types=model_cfg.moa_types, **load_summary(load))
        write_atomic(out / "expert_load.csv", load.to_csv(index=False))
    return costs


def run(cfg: DictConfig) -> dict:
    from .. import backend  # imports fairseq, which fills Hydra's config store: only once composed

    ckpt = resolve_checkpoint(cfg.ckpt)
    data_bin = prepare(cfg.data, cfg.paths.data_root)
    loaded = backend.load_model(ckpt, data_bin, cfg.device, cfg.precision)
    result, quality = translate_and_score(cfg, loaded, data_bin)
    out = run_dir()
    metrics = {
        "verb": "eval", "data": cfg.data.name, "split": cfg.split, "test_set": test_set_of(data_bin, cfg.split),
        **quality,
        "beam": cfg.generation.beam, "lenpen": cfg.generation.lenpen,
        **model_costs(loaded, cfg.split, out), **kept_columns(mask_without(loaded.model, ())),
        "sentences": result.sentences, "sentences_per_s": round(result.sentences / result.seconds, 2),
        "tokens_per_s": round(result.tokens / result.seconds, 1), "device": loaded.device,
        "precision": cfg.precision, "seed": cfg.seed, "git_sha": git_sha(),
        "checkpoint": str(ckpt.absolute()), "data_bin": str(data_bin),
    }
    write_atomic(out / f"hypotheses.{cfg.split}.txt", "".join(h + "\n" for h in result.hypotheses))
    write_json(out / "metrics.json", metrics)
    print(f"BLEU {metrics['bleu']:.2f}  chrF {metrics['chrf']:.2f}  ({result.sentences} sentences, "
          f"{metrics['sentences_per_s']} sentences/s)  {metrics['bleu_signature']}")
    print(f"{metrics['n_params']:,} parameters, {metrics['macs_per_token']:,} MACs per target token "
          f"({metrics['attention_macs_per_token']:,} in attention)"
          + (f"; expert load CV {metrics['expert_load_cv']}, shares {metrics['expert_share_min']}-"
             f"{metrics['expert_share_max']}, router entropy {metrics['router_entropy']} nats"
             if "expert_load_cv" in metrics else ""))
    return metrics


main = hydra_app("eval")(run)
