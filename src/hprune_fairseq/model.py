"""`hprune_transformer`: fairseq's Transformer with HeadAttention in every attention sublayer.

Everything but the attention modules is stock fairseq (embeddings, FFN, layer norms, incremental decoding),
and the state-dict keys are the stock `transformer` ones. The three attention types are named as in
Voita et al.: enc-self, dec-self, dec-enc.

A physically pruned model records the heads it kept in its config (`--kept-heads`, JSON in the head-mask
layout: {type: [[original head ids] per layer]}); `build_model` removes the others before the weights are
loaded, so stock `fairseq-generate --user-dir` reloads pruned checkpoints too.

A Marian (OPUS-MT) model imported from Hugging Face is an `hprune_transformer` with `--marian-positions`,
`--decoder-start-embedding` and `--output-bias` (embeddings.py).

`hprune_moa` is the same model with mixtures of attention experts (moa.MoAAttention) in the attention types
of `--moa-types`; its experts take the place of heads in masks, gates and physical pruning.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

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

from hprune.attention_types import ATTENTION_TYPES, check_attention_types

from . import subset
from .attention import HeadAttention
from .embeddings import MarianPositionalEmbedding, StartTokenEmbedding, add_output_bias
from .gates import HardConcreteGate
from .moa import MoAAttention


def _moa(cfg, kind: str, embed_dim: int, **kwargs) -> Optional[MoAAttention]:
    """A MoA attention for this attention type if the model config makes it one (`--moa-types`)."""
    if kind not in (getattr(cfg, "moa_types", None) or "").split(","):
        return None
    return MoAAttention(embed_dim, cfg.moa_experts, cfg.moa_top_k, cfg.moa_head_dim, dropout=cfg.attention_dropout,
                        renormalize=cfg.moa_renormalize, switch_loss=cfg.moa_switch_loss, z_loss=cfg.moa_z_loss,
                        cv_loss=cfg.moa_cv_loss, **kwargs)


def _swish(layer, cfg) -> None:
    """fairseq 0.12's `--activation-fn swish` returns the class torch.nn.SiLU, which a layer then calls on its
    input (building a module, not an activation); the function it means is F.silu."""
    if getattr(cfg, "activation_fn", None) == "swish":
        layer.activation_fn = torch.nn.functional.silu


class HeadEncoderLayer(TransformerEncoderLayerBase):
    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        _swish(self, cfg)

    def build_self_attention(self, embed_dim, cfg):
        return _moa(cfg, "enc-self", embed_dim, self_attention=True) or HeadAttention(
            embed_dim, cfg.encoder.attention_heads, dropout=cfg.attention_dropout, self_attention=True,
            q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size)


class HeadDecoderLayer(TransformerDecoderLayerBase):
    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        _swish(self, cfg)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if add_bias_kv or add_zero_attn or cfg.cross_self_attention:
            raise NotImplementedError("hprune_transformer supports neither add_bias_kv, add_zero_attn "
                                      "nor cross_self_attention")
        return _moa(cfg, "dec-self", embed_dim, self_attention=True) or HeadAttention(
            embed_dim, cfg.decoder.attention_heads, dropout=cfg.attention_dropout, self_attention=True,
            q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size)

    def build_encoder_attention(self, embed_dim, cfg):
        moa = _moa(cfg, "dec-enc", embed_dim, kdim=cfg.encoder.embed_dim, vdim=cfg.encoder.embed_dim,
                   encoder_decoder_attention=True)
        return moa or HeadAttention(embed_dim, cfg.decoder.attention_heads, kdim=cfg.encoder.embed_dim,
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


def _set_query_padding(owner: torch.nn.Module, tokens: Tensor, pad: int) -> None:
    """MoA routes real tokens only. fairseq gives attention layers the key padding only, so the encoder and
    decoder hand their MoA layers the query side before each forward."""
    if not hasattr(owner, "_moa_layers"):
        owner._moa_layers = [m for m in owner.modules() if isinstance(m, MoAAttention)]
    padding = tokens.eq(pad) if owner._moa_layers else None
    for module in owner._moa_layers:
        module.query_padding_mask = padding


class MoAEncoder(HeadEncoder):
    """An encoder with MoA layers (they need the query padding; not scriptable, unlike the dense model)."""

    def forward_scriptable(self, src_tokens, *args, **kwargs):
        _set_query_padding(self, src_tokens, self.padding_idx)
        return super().forward_scriptable(src_tokens, *args, **kwargs)


class MoADecoder(HeadDecoder):
    def extract_features_scriptable(self, prev_output_tokens, encoder_out, incremental_state=None, *args, **kwargs):
        tokens = prev_output_tokens[:, -1:] if incremental_state is not None else prev_output_tokens
        _set_query_padding(self, tokens, self.padding_idx)
        return super().extract_features_scriptable(prev_output_tokens, encoder_out, incremental_state, *args,
                                                   **kwargs)


def _draw_subset(model, args) -> None:
    selector = getattr(model, "head_selector", None)
    if selector is not None and model.training:
        selector.sample()


@dataclass(frozen=True)
class Sublayer:
    """One residual sublayer of a transformer layer, as the data meets it: an attention (`kind` is its type) or
    the feed-forward (`kind` None). `call`: which of its layer's residual connections adds it back; `norm` is
    its layer norm (applied before it in a pre-norm layer, after the residual sum in a post-norm one)."""
    stack: str             # encoder | decoder
    kind: Optional[str]
    layer: int             # the layer's index in its stack
    block: Any             # the transformer layer holding it
    call: int
    norm: Any
    module: Any            # the attention module, or None for the feed-forward (block.fc1, fc2, activation_fn)


def sublayers(model) -> List[Sublayer]:
    """Every residual sublayer of an encoder-decoder transformer in forward order: each encoder layer's
    self-attention and feed-forward, then each decoder layer's self-attention, encoder attention (where the
    layer has one) and feed-forward. The one description of a layer's anatomy (Kwon et al.'s layer-by-layer
    mask tuning and LRP's relevance pass both walk it)."""
    out = []
    for i, layer in enumerate(model.encoder.layers):
        out += [Sublayer("encoder", "enc-self", i, layer, 0, layer.self_attn_layer_norm, layer.self_attn),
                Sublayer("encoder", None, i, layer, 1, layer.final_layer_norm, None)]
    for i, layer in enumerate(model.decoder.layers):
        out.append(Sublayer("decoder", "dec-self", i, layer, 0, layer.self_attn_layer_norm, layer.self_attn))
        if layer.encoder_attn is not None:
            out.append(Sublayer("decoder", "dec-enc", i, layer, 1, layer.encoder_attn_layer_norm, layer.encoder_attn))
        out.append(Sublayer("decoder", None, i, layer, out[-1].call + 1, layer.final_layer_norm, None))
    return out


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
        parser.add_argument("--dsp-heads", type=int, default=None, metavar="K",
                            help="Differentiable Subset Pruning: keep exactly K heads of --dsp-types (subset.py)")
        parser.add_argument("--dsp-types", type=str, default=None, metavar="TYPES",
                            help="attention types whose heads DSP selects from, comma-separated")
        parser.add_argument("--dsp-temperature", type=str, default=",".join(map(str, subset.TEMPERATURE)), metavar="T0,T1",
                            help="DSP: initial and final temperature")
        parser.add_argument("--dsp-cooldown", type=int, default=subset.COOLDOWN, metavar="N",
                            help="DSP: training steps over which the temperature falls (log-linearly)")
        parser.add_argument("--dsp-straight-through", action="store_true",
                            help="DSP: hard top-K in the forward pass, gradients straight through")
        parser.add_argument("--dsp-logit-scale", type=float, default=1.0, metavar="C",
                            help="DSP: logits = C · θ, so Adam moves them about C times the learning rate")
        parser.add_argument("--dsp-logits-only", action="store_true",
                            help="DSP: train the logits only, the model frozen (the reference's pipelined mode)")
        parser.add_argument("--freeze-decoder", action="store_true",
                            help="train only the encoder (and the embeddings it shares): Voita et al.'s setting for "
                                 "enc-self gates, so head functions do not move to the decoder")
        # a Marian model's computations (embeddings.py; written by `hprune` when it imports one)
        parser.add_argument("--marian-positions", action="store_true",
                            help="Marian's sinusoidal positions (first token at 0, frequencies 10000^(-2i/d))")
        parser.add_argument("--decoder-start-embedding", action="store_true",
                            help="a vector of its own for the decoder's first input (eos), as Marian's <pad> start")
        parser.add_argument("--output-bias", action="store_true",
                            help="a bias on the output projection (Marian's final_logits_bias)")

    @classmethod
    def build_model(cls, args, task):
        model = super().build_model(args, task)
        if getattr(args, "kept_heads", None):
            model.keep_heads(json.loads(args.kept_heads))
        if getattr(args, "head_gates", None):
            model.add_gates(args.head_gates.split(","), getattr(args, "gate_log_alpha_init", None))
        if getattr(args, "dsp_heads", None) is not None:  # (flags left at their default may be absent)
            temperature = getattr(args, "dsp_temperature", None)
            initial, final = (float(t) for t in temperature.split(",")) if temperature else subset.TEMPERATURE
            model.add_subset_selector((getattr(args, "dsp_types", None) or ",".join(ATTENTION_TYPES)).split(","),
                                      args.dsp_heads, (initial, final), getattr(args, "dsp_cooldown", subset.COOLDOWN),
                                      getattr(args, "dsp_straight_through", False),
                                      getattr(args, "dsp_logit_scale", 1.0))
            if getattr(args, "dsp_logits_only", False):
                for name, p in model.named_parameters():
                    p.requires_grad_(name == "head_selector.theta")
        if getattr(args, "freeze_decoder", False):
            shared = {id(p) for p in model.encoder.parameters()}
            for p in model.decoder.parameters():
                if id(p) not in shared:
                    p.requires_grad_(False)
        return model

    encoder_class, decoder_class = HeadEncoder, HeadDecoder

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        encoder = cls.encoder_class(cfg, src_dict, embed_tokens)
        if getattr(args, "marian_positions", False):
            encoder.embed_positions = MarianPositionalEmbedding(cfg.max_source_positions, cfg.encoder.embed_dim,
                                                                encoder.padding_idx)
        return encoder

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        decoder = cls.decoder_class(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)
        if getattr(args, "marian_positions", False):
            decoder.embed_positions = MarianPositionalEmbedding(cfg.max_target_positions, cfg.decoder.embed_dim,
                                                                decoder.padding_idx)
        if getattr(args, "decoder_start_embedding", False):
            decoder.embed_tokens = StartTokenEmbedding(decoder.embed_tokens, tgt_dict.eos())
        if getattr(args, "output_bias", False):
            add_output_bias(decoder.output_projection)
        return decoder

    def attention_modules(self) -> Iterator[Tuple[str, int, HeadAttention]]:
        """(attention type, layer index, module) for every attention sublayer, in a fixed order."""
        for i, layer in enumerate(self.encoder.layers):
            yield "enc-self", i, layer.self_attn
        for i, layer in enumerate(self.decoder.layers):
            yield "dec-self", i, layer.self_attn
        for i, layer in enumerate(self.decoder.layers):
            if layer.encoder_attn is not None:
                yield "dec-enc", i, layer.encoder_attn

    def sublayers(self) -> List[Sublayer]:
        return sublayers(self)

    def set_head_mask(self, mask: Optional[Dict[str, List[List[float]]]]) -> None:
        """Apply a head mask in the shared schema ({type: [[1, 0, ...] per layer]}); None keeps every head."""
        for kind, layer, module in self.attention_modules():
            module.set_head_mask(None if mask is None else mask[kind][layer])

    def record_heads(self, weights: bool = False, outputs: bool = False, contributions: bool = False) -> None:
        """Keep each attention's last per-head weights, outputs and/or shares of the output (`head_weights`,
        `head_outputs`, `unit_contributions`)."""
        for _, _, module in self.attention_modules():
            module.record_weights, module.record_outputs, module.record_contributions = weights, outputs, contributions
            module.head_weights = module.head_outputs = module.unit_contributions = None

    def head_ids(self) -> Dict[str, List[List[int]]]:
        """The original ids of the heads each layer still has, in the head-mask layout."""
        kept: Dict[str, List[List[int]]] = {}
        for kind, _, module in self.attention_modules():
            kept.setdefault(kind, []).append(list(module.head_ids))
        return kept

    def add_gates(self, types: List[str], init: Optional[float] = None) -> None:
        types = check_attention_types(types, "--head-gates", "enc-self")
        for kind, _, module in self.attention_modules():
            if kind in types:
                module.add_gate(init)
        # the head-budget controller's state (criterion `hprune`, l0_budget): the updates taken (set with
        # fairseq's update count, so the schedule is in updates whatever the workers and update_freq) and the
        # heads kept at the start; integers, so fp16/bf16 cannot round them away; saved with the model, so a
        # resumed run continues where it stopped
        self.register_buffer("budget_state", torch.zeros(2, dtype=torch.long))

    def set_num_updates(self, num_updates: int) -> None:
        super().set_num_updates(num_updates)
        if hasattr(self, "budget_state"):
            self.budget_state[0] = num_updates

    def add_subset_selector(self, types: List[str], k: int, temperature: tuple, cooldown: int,
                            straight_through: bool, logit_scale: float) -> None:
        """DSP (subset.py) over the heads of `types`: one logit per head, initialised Xavier-uniform for a
        (sublayers, heads per sublayer) matrix as the reference's, and each module's gate its slice of the mask."""
        types = check_attention_types(types, "--dsp-types", "enc-self")
        modules = [m for kind, _, m in self.attention_modules() if kind in types]
        sizes = [m.num_heads for m in modules]
        bound = math.sqrt(6.0 / (len(modules) + max(sizes)))
        self.head_selector = subset.SubsetSelector(sum(sizes), k, temperature, cooldown, straight_through,
                                                   logit_scale, bound).to(next(self.parameters()).device)
        for module, gate in zip(modules, self.head_selector.gates(sizes)):
            module.gate = gate
        # each training forward draws its mask first (a hook, not a forward override: the model stays scriptable)
        self.register_forward_pre_hook(_draw_subset)

    def upgrade_state_dict_named(self, state_dict, name):
        """A gated or DSP model loads a plain checkpoint: its budget state and DSP step start at zero, its DSP
        logits where they were initialised (gates: HeadAttention)."""
        super().upgrade_state_dict_named(state_dict, name)
        prefix = f"{name}." if name else ""
        if hasattr(self, "budget_state") and f"{prefix}budget_state" not in state_dict:
            state_dict[f"{prefix}budget_state"] = torch.zeros(2, dtype=torch.long)
        selector = getattr(self, "head_selector", None)
        if selector is not None and f"{prefix}head_selector.theta" not in state_dict:
            state_dict[f"{prefix}head_selector.theta"] = selector.theta.detach().clone()
            state_dict[f"{prefix}head_selector.step"] = torch.zeros((), dtype=torch.long)

    def gates(self) -> Iterator[Tuple[str, int, HeadAttention]]:
        """The attention modules with Hard Concrete gates, as attention_modules() names them."""
        return ((kind, layer, m) for kind, layer, m in self.attention_modules() if isinstance(m.gate, HardConcreteGate))

    def fold_gates(self, values: Optional[Dict[Tuple[str, int, int], float]] = None) -> None:
        """Fold every deterministic gate (Hard Concrete or DSP) into its out_proj columns (HeadAttention.fold_gate):
        same outputs in eval mode, and a plain ungated model that can be masked, fine-tuned and physically pruned.
        `values`: {(type, layer, head): value} folded instead (a read-out other than the gates' own)."""
        for kind, layer, module in self.attention_modules():
            if module.gate is not None:
                weight = next(module.parameters())
                module.fold_gate(None if values is None else torch.tensor(
                    [values[(kind, layer, h)] for h in module.head_ids], dtype=weight.dtype, device=weight.device))
        for buffer in ("budget_state", "head_selector"):
            if hasattr(self, buffer):
                delattr(self, buffer)

    def gate_open_probabilities(self) -> Tuple[Tensor, Tensor, int]:
        """P(gate ≠ 0) and the deterministic gate of every gated head, concatenated over the gated modules, and
        the number of those modules. One computation for all (add_gate gives every gate the same β, l, r): per
        module, a training step's small ops cost more than the gates themselves."""
        gates = [m.gate for _, _, m in self.gates()]
        if not gates:
            raise ValueError("the model has no head gates (--head-gates)")
        log_alpha = torch.cat([gate.log_alpha for gate in gates])
        return gates[0].p_open(log_alpha), gates[0].deterministic(log_alpha.detach()), len(gates)

    def gate_penalty(self, normalize: str = "sum", open_probabilities=None) -> Tensor:
        """Expected number of open gates, Σ P(gate ≠ 0): over every gated head ("sum", the paper's L_C), or the
        mean over gated layers of each layer's sum ("layer_mean", the reference code's). open_probabilities:
        gate_open_probabilities(), when the caller has it already."""
        p_open, _, layers = open_probabilities or self.gate_open_probabilities()
        if normalize == "sum":
            return p_open.sum()
        if normalize == "layer_mean":
            return p_open.sum() / layers
        raise ValueError(f"unknown L0 normalisation '{normalize}'; use sum or layer_mean")

    def moa_layers(self) -> Iterator[Tuple[str, int, MoAAttention]]:
        """The attention sublayers that are MoA layers (none in an hprune_transformer)."""
        return ((kind, layer, m) for kind, layer, m in self.attention_modules() if isinstance(m, MoAAttention))

    def moa_aux_loss(self) -> Optional[Tensor]:
        """The weighted auxiliary losses of the last forward, summed over MoA layers (per token, see moa.py)."""
        losses = [m.aux_loss for _, _, m in self.moa_layers() if m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

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


@register_model("hprune_moa")
class HpruneMoAModel(HpruneTransformerModel):
    """hprune_transformer whose attention sublayers of `--moa-types` are mixtures of attention experts
    (moa.MoAAttention); the other sublayers keep their fairseq heads."""

    encoder_class, decoder_class = MoAEncoder, MoADecoder

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--moa-types", type=str, metavar="TYPES",
                            help=f"attention types that are MoA layers, comma-separated ({', '.join(ATTENTION_TYPES)})")
        parser.add_argument("--moa-experts", type=int, metavar="E", help="attention experts per MoA layer")
        parser.add_argument("--moa-top-k", type=int, metavar="K", help="experts each token uses (k <= E)")
        parser.add_argument("--moa-head-dim", type=int, metavar="D", help="size of each expert's query, and of "
                                                                          "the shared key and value")
        parser.add_argument("--moa-renormalize", action="store_true",
                            help="divide the selected experts' weights by their (detached) sum, as the paper")
        parser.add_argument("--moa-switch-loss", type=float, metavar="C", help="switch load-balancing loss weight")
        parser.add_argument("--moa-z-loss", type=float, metavar="C", help="router z-loss weight")
        parser.add_argument("--moa-cv-loss", type=float, metavar="C", help="CV² load loss weight")

    @classmethod
    def build_model(cls, args, task):
        check_attention_types(args.moa_types, "--moa-types", "enc-self")
        return super().build_model(args, task)



def _moa_defaults(args, experts: int, top_k: int, head_dim: int) -> None:
    args.moa_types = getattr(args, "moa_types", None) or ",".join(ATTENTION_TYPES)
    args.moa_experts = getattr(args, "moa_experts", None) or experts
    args.moa_top_k = getattr(args, "moa_top_k", None) or top_k
    args.moa_head_dim = getattr(args, "moa_head_dim", None) or head_dim
    args.moa_renormalize = getattr(args, "moa_renormalize", False)
    for name, default in (("moa_switch_loss", 0.01), ("moa_z_loss", 0.001), ("moa_cv_loss", 0.0)):
        if getattr(args, name, None) is None:
            setattr(args, name, default)


@register_model_architecture("hprune_moa", "hprune_moa")
def hprune_moa(args):
    """MoA-Base, "8K8E128D" (the released run.sh): base dimensions, 8 experts of 128, all 8 used per token."""
    _moa_defaults(args, experts=8, top_k=8, head_dim=128)
    base_architecture(args)


@register_model_architecture("hprune_moa", "hprune_moa_big")
def hprune_moa_big(args):
    """MoA-Big, "16K32E256D": big dimensions, 32 experts of 256, 16 used per token."""
    _moa_defaults(args, experts=32, top_k=16, head_dim=256)
    transformer_wmt_en_de_big(args)
