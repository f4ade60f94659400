"""`hprune_transformer`: fairseq's Transformer with HeadAttention in every attention sublayer.

Everything but the attention modules is stock fairseq (embeddings, FFN, layer norms, incremental decoding),
and the state-dict keys are the stock `transformer` ones. The three attention types are named as in
Voita et al.: enc-self, dec-self, dec-enc.

A physically pruned model records the heads it kept in its config (`--kept-heads`, JSON in the head-mask
layout: {type: [[original head ids] per layer]}); `build_model` removes the others before the weights are
loaded, so stock `fairseq-generate --user-dir` reloads pruned checkpoints too.
"""
from __future__ import annotations

import json
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
    base_architecture,
    transformer_wmt_en_de_big,
)
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from torch import Tensor

from .attention import HeadAttention

ATTENTION_TYPES = ("enc-self", "dec-self", "dec-enc")


class HeadEncoderLayer(TransformerEncoderLayerBase):
    def build_self_attention(self, embed_dim, cfg):
        return HeadAttention(embed_dim, cfg.encoder.attention_heads, dropout=cfg.attention_dropout,
                             self_attention=True, q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size)


class HeadDecoderLayer(TransformerDecoderLayerBase):
    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if add_bias_kv or add_zero_attn or cfg.cross_self_attention:
            raise NotImplementedError("hprune_transformer supports neither add_bias_kv, add_zero_attn "
                                      "nor cross_self_attention")
        return HeadAttention(embed_dim, cfg.decoder.attention_heads, dropout=cfg.attention_dropout,
                             self_attention=True, q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size)

    def build_encoder_attention(self, embed_dim, cfg):
        return HeadAttention(embed_dim, cfg.decoder.attention_heads, kdim=cfg.encoder.embed_dim,
                             vdim=cfg.encoder.embed_dim, dropout=cfg.attention_dropout,
                             encoder_decoder_attention=True, q_noise=self.quant_noise,
                             qn_block_size=self.quant_noise_block_size)


def _wrap(layer, cfg):
    """Activation checkpointing and FSDP wrapping, as fairseq does for its own layers."""
    if cfg.checkpoint_activations:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not cfg.checkpoint_activations else 0)


class HeadEncoder(TransformerEncoderBase):
    def build_encoder_layer(self, cfg):
        return _wrap(HeadEncoderLayer(cfg, return_fc=self.return_fc), cfg)


class HeadDecoder(TransformerDecoderBase):
    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return _wrap(HeadDecoderLayer(cfg, no_encoder_attn), cfg)


@register_model("hprune_transformer")
class HpruneTransformerModel(TransformerModel):
    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--kept-heads", type=str, default=None, metavar="JSON",
                            help="heads kept by physical pruning: {type: [[head ids] per layer]}; written by "
                                 "`hprune prune`, not meant to be typed")
        parser.add_argument("--head-gates", type=str, default=None, metavar="TYPES",
                            help="Hard Concrete gates on the heads of these attention types, comma-separated "
                                 f"({', '.join(ATTENTION_TYPES)})")
        parser.add_argument("--gate-log-alpha-init", type=float, default=None, metavar="X",
                            help="initial log alpha of every gate (default: Glorot-uniform, as Voita et al.)")
        parser.add_argument("--freeze-decoder", action="store_true",
                            help="train only the encoder (and the embeddings it shares): Voita et al.'s setting for "
                                 "enc-self gates, so head functions do not move to the decoder")

    @classmethod
    def build_model(cls, args, task):
        model = super().build_model(args, task)
        if getattr(args, "kept_heads", None):
            model.keep_heads(json.loads(args.kept_heads))
        if getattr(args, "head_gates", None):
            model.add_gates(args.head_gates.split(","), getattr(args, "gate_log_alpha_init", None))
        if getattr(args, "freeze_decoder", False):
            shared = {id(p) for p in model.encoder.parameters()}
            for p in model.decoder.parameters():
                if id(p) not in shared:
                    p.requires_grad_(False)
        return model

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return HeadEncoder(TransformerConfig.from_namespace(args), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return HeadDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)

    def attention_modules(self) -> Iterator[Tuple[str, int, HeadAttention]]:
        """(attention type, layer index, module) for every attention sublayer, in a fixed order."""
        for i, layer in enumerate(self.encoder.layers):
            yield "enc-self", i, layer.self_attn
        for i, layer in enumerate(self.decoder.layers):
            yield "dec-self", i, layer.self_attn
        for i, layer in enumerate(self.decoder.layers):
            if layer.encoder_attn is not None:
                yield "dec-enc", i, layer.encoder_attn

    def set_head_mask(self, mask: Optional[Dict[str, List[List[float]]]]) -> None:
        """Apply a head mask in the shared schema ({type: [[1, 0, ...] per layer]}); None keeps every head."""
        for kind, layer, module in self.attention_modules():
            module.set_head_mask(None if mask is None else mask[kind][layer])

    def record_heads(self, weights: bool = False, outputs: bool = False) -> None:
        """Keep each attention's last per-head weights and/or outputs (`head_weights`, `head_outputs`)."""
        for _, _, module in self.attention_modules():
            module.record_weights, module.record_outputs = weights, outputs
            module.head_weights = module.head_outputs = None

    def head_ids(self) -> Dict[str, List[List[int]]]:
        """The original ids of the heads each layer still has, in the head-mask layout."""
        kept: Dict[str, List[List[int]]] = {}
        for kind, _, module in self.attention_modules():
            kept.setdefault(kind, []).append(list(module.head_ids))
        return kept

    def add_gates(self, types: List[str], init: Optional[float] = None) -> None:
        unknown = set(types) - set(ATTENTION_TYPES)
        if unknown:
            raise ValueError(f"unknown attention type(s) {sorted(unknown)} for --head-gates; "
                             f"choose from {', '.join(ATTENTION_TYPES)}")
        for kind, _, module in self.attention_modules():
            if kind in types:
                module.add_gate(init)
        # the head-budget controller's state (criterion `hprune_l0`, l0_budget): integers, so fp16/bf16 cannot
        # round them away; saved with the model, so a resumed run continues where it stopped
        self.register_buffer("budget_state", torch.zeros(2, dtype=torch.long))

    def upgrade_state_dict_named(self, state_dict, name):
        """A gated model loads an ungated checkpoint: its budget state starts at zero (gates: HeadAttention)."""
        super().upgrade_state_dict_named(state_dict, name)
        key = f"{name}.budget_state" if name else "budget_state"
        if hasattr(self, "budget_state") and key not in state_dict:
            state_dict[key] = torch.zeros(2, dtype=torch.long)

    def gates(self) -> Iterator[Tuple[str, int, HeadAttention]]:
        """The gated attention modules, as attention_modules() names them."""
        return ((kind, layer, m) for kind, layer, m in self.attention_modules() if m.gate is not None)

    def fold_gates(self) -> None:
        """Fold every deterministic gate into its out_proj columns (HeadAttention.fold_gate): same outputs in
        eval mode, and a plain ungated model that can be masked, fine-tuned and physically pruned."""
        for _, _, module in list(self.gates()):
            module.fold_gate()
        if hasattr(self, "budget_state"):
            del self.budget_state

    def gate_penalty(self, normalize: str = "sum") -> Tensor:
        """Expected number of open gates, Σ P(gate ≠ 0): over every gated head ("sum", the paper's L_C), or the
        mean over gated layers of each layer's sum ("layer_mean", the reference code's)."""
        per_layer = [m.gate.p_open().sum() for _, _, m in self.gates()]
        if not per_layer:
            raise ValueError("the model has no head gates (--head-gates)")
        total = torch.stack(per_layer).sum()
        if normalize == "sum":
            return total
        if normalize == "layer_mean":
            return total / len(per_layer)
        raise ValueError(f"unknown L0 normalisation '{normalize}'; use sum or layer_mean")

    def keep_heads(self, kept: Dict[str, List[List[int]]]) -> None:
        """Physically remove every head not listed (see HeadAttention.prune_heads)."""
        for kind, layer, module in self.attention_modules():
            module.prune_heads(kept[kind][layer])


@register_model_architecture("hprune_transformer", "hprune_transformer")
def hprune_transformer(args):
    """Vaswani et al. base dimensions unless the command line says otherwise."""
    base_architecture(args)


@register_model_architecture("hprune_transformer", "hprune_transformer_big")
def hprune_transformer_big(args):
    transformer_wmt_en_de_big(args)
