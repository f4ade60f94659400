"""`hprune_transformer`: fairseq's Transformer with HeadAttention in every attention sublayer (layers.py).

A physically pruned model records the heads it kept in its config (`--kept-heads`, JSON in the head-mask
layout: {type: [[original head ids] per layer]}); `build_model` removes the others before the weights are
loaded, so stock `fairseq-generate --user-dir` reloads pruned checkpoints too; the FFN neurons it kept the same way
(`--kept-neurons`, {ffn type: [[original neuron ids] per layer]}, ffn.py).

A pruning mechanism a procedure trains inside the model (mechanisms/: Hard Concrete gates, DSP's subset
selection, or one registered outside hprune) adds its own flags and installs itself when they ask for it; the
model folds any of them into the weights the same way (`fold_mechanisms`), and says which it has
(`mechanisms()`), so nothing outside the plugin names them.

A Marian (OPUS-MT) model imported from Hugging Face is an `hprune_transformer` with `--marian-positions`,
`--decoder-start-embedding` and `--output-bias` (marian.py).

`hprune_moa` is the same model with mixtures of attention experts (moa.MoAAttention) in the attention types
of `--moa-types`; its experts take the place of heads in masks, gates and physical pruning.
"""
from __future__ import annotations

import contextlib
import json
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerModel,
    base_architecture,
    transformer_wmt_en_de_big,
)
from torch import Tensor

from hprune.attention_types import ATTENTION_TYPES, FFN_TYPES, check_attention_types
from hprune.registry import import_plugin

from . import mechanisms
from .config import HpruneConfig, MoAConfig
from .ffn import keep_neurons
from .heads import HeadAttention
from .layers import Captured, HeadDecoder, HeadEncoder, MoADecoder, MoAEncoder, Sublayer, capture_residuals, sublayers
from .marian import MarianPositionalEmbedding, StartTokenEmbedding, add_output_bias
from .moa import MoAAttention


@register_model("hprune_transformer")
class HpruneTransformerModel(TransformerModel):
    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        for action in parser._actions:  # fairseq computes swish (Marian's FFN) but does not offer it: a training
            if "--activation-fn" in action.option_strings and "swish" not in action.choices:  # run that continues
                action.choices = [*action.choices, "swish"]  # an imported Marian model passes it on
        gen_parser_from_dataclass(parser, HpruneConfig())
        for mechanism in mechanisms.MECHANISMS.values():
            gen_parser_from_dataclass(parser, mechanism.config())

    @classmethod
    def build_model(cls, args, task):
        for module in filter(None, (getattr(args, "plugin_modules", None) or "").split(",")):
            import_plugin(module, "--plugin-modules")
        model = super().build_model(args, task)
        if getattr(args, "kept_heads", None):
            model.keep_heads(json.loads(args.kept_heads))
        if getattr(args, "kept_neurons", None):
            model.keep_neurons(json.loads(args.kept_neurons))
        for mechanism in mechanisms.MECHANISMS.values():  # (flags left at their default may be absent)
            if mechanism.wanted(args):
                mechanism.install(model, args)
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

    # ------------------------------------------------------------------------------------------- the heads
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

    def capture_residuals(self, sublayer: Sublayer, sink: list):
        """A context: (output, residual) of `sublayer` appended to `sink` on every forward (layers.py)."""
        return capture_residuals(sublayer, sink)

    def forward_to(self, sublayer: Sublayer, **net_input) -> Tuple[torch.Tensor, torch.Tensor]:
        """(output, residual) of `sublayer` on a forward that stops there: the layers above it and the output
        projection (at a 256k vocabulary, as much as the rest of the model) are not run."""
        sink: list = []
        with contextlib.suppress(Captured), capture_residuals(sublayer, sink, stop=True):
            self(**net_input)
        return sink[0]

    def set_head_mask(self, mask: Optional[Dict[str, List[List[float]]]]) -> None:
        """Apply a head mask in the shared schema ({type: [[1, 0, ...] per layer]}); None keeps every head."""
        for attn_type, layer, module in self.attention_modules():
            module.set_head_mask(None if mask is None else mask[attn_type][layer])
        for ffn_type, layer, block in self.ffn_layers():  # a mask's neuron rows, where it has them
            block.fc2.set_neuron_mask(None if mask is None or ffn_type not in mask else mask[ffn_type][layer])

    def record_heads(self, weights: bool = False, outputs: bool = False, contributions: bool = False) -> None:
        """Keep each attention's last per-head weights, outputs and/or shares of the output (`head_weights`,
        `head_outputs`, `unit_contributions`)."""
        for _, _, module in self.attention_modules():
            module.record_weights, module.record_outputs, module.record_contributions = weights, outputs, contributions
            module.head_weights = module.head_outputs = module.unit_contributions = None

    def head_ids(self) -> Dict[str, List[List[int]]]:
        """The original ids of the heads each layer still has, in the head-mask layout."""
        kept: Dict[str, List[List[int]]] = {}
        for attn_type, _, module in self.attention_modules():
            kept.setdefault(attn_type, []).append(list(module.head_ids))
        return kept

    def keep_heads(self, kept: Dict[str, List[List[int]]]) -> None:
        """Physically remove every head not listed (see HeadUnits.keep_heads)."""
        for attn_type, layer, module in self.attention_modules():
            module.keep_heads(kept[attn_type][layer])

    # ------------------------------------------------------------------------------------------- FFN neurons
    def ffn_layers(self) -> Iterator[Tuple[str, int, torch.nn.Module]]:
        """(FFN type, layer index, transformer layer) of every feed-forward sublayer; its fc2 is an
        ffn.NeuronOutput, whose neurons a mask holds under the FFN type (`enc-ffn`, `dec-ffn`)."""
        for i, layer in enumerate(self.encoder.layers):
            yield FFN_TYPES[0], i, layer
        for i, layer in enumerate(self.decoder.layers):
            yield FFN_TYPES[1], i, layer

    def record_neurons(self, inputs: bool = False) -> None:
        """Keep each fc2's last (masked) input, the activations of its neurons (`fc2.neuron_inputs`)."""
        for _, _, block in self.ffn_layers():
            block.fc2.record_inputs, block.fc2.neuron_inputs = inputs, None

    def neuron_ids(self) -> Dict[str, List[List[int]]]:
        """The original ids of the neurons each FFN still has, in the mask layout."""
        kept: Dict[str, List[List[int]]] = {}
        for ffn_type, _, block in self.ffn_layers():
            kept.setdefault(ffn_type, []).append(list(block.fc2.neuron_ids))
        return kept

    def keep_neurons(self, kept: Dict[str, List[List[int]]]) -> None:
        """Physically remove every neuron not listed, in the FFN types `kept` names (ffn.keep_neurons)."""
        for ffn_type, layer, block in self.ffn_layers():
            if ffn_type not in kept:
                continue
            if getattr(block, "ffn_layernorm", None) is not None:
                raise ValueError("FFN neurons cannot be removed exactly from a layer with --scale-fc (a layer norm "
                                 "over them)")
            keep_neurons(block, kept[ffn_type][layer])

    # ------------------------------------------------------------------------------------------- mechanisms
    def mechanisms(self) -> List[mechanisms.Mechanism]:
        """The pruning mechanisms installed on this model, not yet folded."""
        return mechanisms.present(self)

    def gated_modules(self) -> Iterator[Tuple[str, int, HeadAttention]]:
        """(type, layer, module) of the attention modules a mechanism gates."""
        return mechanisms.gated_modules(self)

    def fold_mechanisms(self, kept: Optional[Dict[str, List[List[int]]]] = None) -> Optional[Dict[str, List[List[int]]]]:
        """Fold the mechanisms' gates into the out_proj weights and drop them: a plain model that computes what
        the gated one did in eval mode, to be masked, fine-tuned and physically pruned. `kept` (a head mask, 0/1)
        says which gated heads stay: each gets its deterministic gate folded in, or its full output where that
        gate is 0 (a head an exact budget or a layout keeps), every other gated head 0; None keeps the gates' own
        read-out (gate > 0). Returns the mask of the heads kept (`kept` itself, completed); a model without
        mechanisms returns `kept` as given."""
        gated, installed = list(self.gated_modules()), self.mechanisms()
        if not gated:
            return kept
        read_out = kept is None
        if read_out:
            kept = {}
            for attn_type, _, module in self.attention_modules():
                kept.setdefault(attn_type, []).append([int(h in module.head_ids) for h in range(module.total_heads)])
        for attn_type, layer, module in gated:
            values = module.gate.deterministic().tolist()
            if read_out:
                for h, gate in zip(module.head_ids, values):
                    kept[attn_type][layer][h] = int(gate > 0)
            weight = next(module.parameters())
            module.fold_gate(torch.tensor([(gate if gate > 0 else 1.0) * kept[attn_type][layer][h]
                                           for h, gate in zip(module.head_ids, values)],
                                          dtype=weight.dtype, device=weight.device))
        for mechanism in installed:
            mechanism.remove(self)
        return kept

    def set_num_updates(self, num_updates: int) -> None:
        super().set_num_updates(num_updates)
        for mechanism in self.mechanisms():
            mechanism.set_num_updates(self, num_updates)

    def upgrade_state_dict_named(self, state_dict, name):
        """A model with mechanisms loads a plain checkpoint: each fills in its initial state."""
        super().upgrade_state_dict_named(state_dict, name)
        for mechanism in self.mechanisms():
            mechanism.upgrade_state_dict(self, state_dict, f"{name}." if name else "")

    # ------------------------------------------------------------------------------------------- MoA
    def moa_layers(self) -> Iterator[Tuple[str, int, MoAAttention]]:
        """The attention sublayers that are MoA layers (none in an hprune_transformer)."""
        return ((attn_type, layer, m) for attn_type, layer, m in self.attention_modules() if isinstance(m, MoAAttention))

    def moa_aux_loss(self) -> Optional[Tensor]:
        """The weighted auxiliary losses of the last forward, summed over MoA layers (per token, see moa.py)."""
        losses = [m.aux_loss for _, _, m in self.moa_layers() if m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None


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
        gen_parser_from_dataclass(parser, MoAConfig())

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
