"""`hprune eval ckpt=PATH [mask=head_mask.json]`: beam search on a split; sacreBLEU BLEU and chrF on
detokenized text; parameters and counted MACs. With a mask, the model runs with the masked heads switched
off (no export needed); the MACs are then those of the model as it runs, masked heads still computed: the
physically pruned model (`prune.export=true`) is the one that is smaller and faster."""
from __future__ import annotations

from omegaconf import DictConfig

from ..files import write_atomic
from ..pruning.heads import is_soft, kept_columns
from ..rundir import model_provenance, run_dir
from . import hydra_app


def evaluate(cfg: DictConfig) -> dict:
    from ..api import Model

    model = Model.from_config(cfg)
    session = model.session
    # None: no mask at all (no multiply by ones); values between 0 and 1 scale their heads' outputs
    mask = session.read_mask(cfg.mask, soft=True) if cfg.mask else None
    out = run_dir()
    result = model.evaluate(mask, costs=True)
    if not result.expert_load.empty:
        write_atomic(out / "expert_load.csv", result.expert_load.to_csv(index=False))
    metrics = {
        "split": cfg.split, "test_set": session.prepared.test_set(cfg.split), "bleu": result.bleu,
        "bleu_signature": result.bleu_signature, "chrf": result.chrf, "chrf_signature": result.chrf_signature,
        "beam": cfg.generation.beam, "lenpen": cfg.generation.lenpen, **result.costs,
        **kept_columns(mask or session.unpruned_mask()), "mask": cfg.mask,
        "mask_soft": mask is not None and is_soft(mask), "sentences": result.sentences,
        "sentences_per_s": result.sentences_per_s, "tokens_per_s": result.tokens_per_s, **model_provenance(session),
    }
    write_atomic(out / f"hypotheses.{cfg.split}.txt", "".join(h + "\n" for h in result.hypotheses))
    print(f"BLEU {metrics['bleu']:.2f}  chrF {metrics['chrf']:.2f}  ({result.sentences} sentences, "
          f"{metrics['sentences_per_s']} sentences/s)  {metrics['bleu_signature']}"
          + (f"  under {cfg.mask}" if cfg.mask else ""))
    print(f"{metrics['n_params']:,} parameters, {metrics['macs_per_token']:,} MACs per target token "
          f"({metrics['attention_macs_per_token']:,} in attention)"
          + (f"; expert load CV {metrics['expert_load_cv']}, shares {metrics['expert_share_min']}-"
             f"{metrics['expert_share_max']}, router entropy {metrics['router_entropy']} nats"
             if "expert_load_cv" in metrics else ""))
    return metrics


main = hydra_app("eval")(evaluate)
