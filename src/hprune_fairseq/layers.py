"""The layers of `hprune_transformer`: fairseq's Transformer layers with HeadAttention (or MoA attention) in
every attention sublayer, the encoder and decoder that build them, and the one description of a layer's anatomy
(`sublayers`: every residual sublayer in forward order) with what walks it needs (`capture_residuals`).

Everything but the attention modules and fc2 (ffn.NeuronOutput: a mask on the FFN's hidden units) is stock
fairseq (embeddings, layer norms, incremental decoding), and the state-dict keys are the stock `transformer` ones.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

import torch
from fairseq.distributed import fsdp_wrap
from fairseq.models.transformer import TransformerDecoderBase, TransformerEncoderBase
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.quant_noise import quant_noise
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from torch import Tensor

from .ffn import NeuronOutput
from .heads import HeadAttention
from .moa import MoAAttention


def _moa(cfg, attn_type: str, embed_dim: int, **kwargs) -> Optional[MoAAttention]:
    """A MoA attention for this attention type if the model config makes it one (`--moa-types`)."""
    if attn_type not in (getattr(cfg, "moa_types", None) or "").split(","):
        return None
    return MoAAttention(embed_dim, cfg.moa_experts, cfg.moa_top_k, cfg.moa_head_dim, dropout=cfg.attention_dropout,
                        renormalize=cfg.moa_renormalize, switch_loss=cfg.moa_switch_loss, z_loss=cfg.moa_z_loss,
                        cv_loss=cfg.moa_cv_loss, **kwargs)


def _swish(layer, cfg) -> None:
    """fairseq 0.12's `--activation-fn swish` returns the class torch.nn.SiLU, which a layer then calls on its
    input (building a module, not an activation); the function it means is F.silu."""
    if getattr(cfg, "activation_fn", None) == "swish":
        layer.activation_fn = torch.nn.functional.silu


class _Layer:
    """What the encoder's and the decoder's layers add to fairseq's: swish fixed, fc2 with a neuron mask."""

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        _swish(self, cfg)

    def build_fc2(self, input_dim, output_dim, q_noise, qn_block_size):
        return quant_noise(NeuronOutput(input_dim, output_dim), q_noise, qn_block_size)


class HeadEncoderLayer(_Layer, TransformerEncoderLayerBase):

    def build_self_attention(self, embed_dim, cfg):
        return _moa(cfg, "enc-self", embed_dim, self_attention=True) or HeadAttention(
            embed_dim, cfg.encoder.attention_heads, dropout=cfg.attention_dropout, self_attention=True,
            q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size)


class HeadDecoderLayer(_Layer, TransformerDecoderLayerBase):
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


@dataclass(frozen=True)
class Sublayer:
    """One residual sublayer of a transformer layer, as the data meets it: an attention (`attn_type`) or
    the feed-forward (`attn_type` None). `call`: which of its layer's residual connections adds it back; `norm` is
    its layer norm (applied before it in a pre-norm layer, after the residual sum in a post-norm one)."""
    stack: str             # encoder | decoder
    attn_type: Optional[str]
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


class Captured(Exception):
    """capture_residuals(stop=True) ends the forward here: what it records is all the caller needs."""


@contextlib.contextmanager
def capture_residuals(sublayer: Sublayer, sink: list, stop: bool = False) -> Iterator[None]:
    """Record (sublayer output, residual) where the sublayer's output joins the residual stream, on every
    forward while the context lasts (fairseq's layers add each sublayer back through residual_connection, in
    forward order: `sublayer.call` says which call is this one's). stop: raise Captured once recorded (the layers
    above and the output projection, half a forward or more, are not run)."""
    block, call = sublayer.block, sublayer.call
    calls = [0]
    reset = block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, 0))
    original = block.residual_connection

    def connect(x, residual):
        if calls[0] == call:
            sink.append((x.detach(), residual.detach()))
            if stop:
                raise Captured
        calls[0] += 1
        return original(x, residual)

    block.residual_connection = connect
    try:
        yield
    finally:
        del block.residual_connection
        reset.remove()
