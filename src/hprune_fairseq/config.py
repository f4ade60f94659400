"""The model flags of `hprune_transformer` and `hprune_moa` beyond fairseq's Transformer, as dataclasses from
which fairseq generates the command-line options (its own way: `gen_parser_from_dataclass`). A pruning
mechanism's flags live with it (mechanisms/)."""
from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import FairseqDataclass

# (No `from __future__ import annotations`: fairseq builds its argument parser from real field types.)


@dataclass
class HpruneConfig(FairseqDataclass):
    kept_heads: Optional[str] = field(default=None, metadata={
        "help": "heads kept by physical pruning: {type: [[head ids] per layer]} (JSON); written by `hprune prune`, "
                "not meant to be typed"})
    kept_neurons: Optional[str] = field(default=None, metadata={
        "help": "FFN neurons kept by physical pruning: {enc-ffn|dec-ffn: [[neuron ids] per layer]} (JSON); written "
                "by `hprune prune`, not meant to be typed"})
    plugin_modules: Optional[str] = field(default=None, metadata={
        "help": "modules (names or .py paths, comma-separated) registering pruning mechanisms kept outside hprune, "
                "imported before the model is built (recorded so that the checkpoint loads anywhere)"})
    freeze_decoder: bool = field(default=False, metadata={
        "help": "train only the encoder (and the embeddings it shares): Voita et al.'s setting for enc-self gates, "
                "so head functions do not move to the decoder"})
    # a Marian model's computations (marian.py; written by `hprune` when it imports one)
    marian_positions: bool = field(default=False, metadata={
        "help": "Marian's sinusoidal positions (first token at 0, frequencies 10000^(-2i/d))"})
    decoder_start_embedding: bool = field(default=False, metadata={
        "help": "a vector of its own for the decoder's first input (eos), as Marian's <pad> start"})
    output_bias: bool = field(default=False, metadata={"help": "a bias on the output projection (Marian's "
                                                               "final_logits_bias)"})


@dataclass
class MoAConfig(FairseqDataclass):
    moa_types: Optional[str] = field(default=None, metadata={
        "help": "attention types that are MoA layers, comma-separated (enc-self, dec-self, dec-enc)"})
    moa_experts: Optional[int] = field(default=None, metadata={"help": "attention experts per MoA layer"})
    moa_top_k: Optional[int] = field(default=None, metadata={"help": "experts each token uses (k <= E)"})
    moa_head_dim: Optional[int] = field(default=None, metadata={
        "help": "size of each expert's query, and of the shared key and value"})
    moa_renormalize: bool = field(default=False, metadata={
        "help": "divide the selected experts' weights by their (detached) sum, as the paper"})
    moa_switch_loss: Optional[float] = field(default=None, metadata={"help": "switch load-balancing loss weight"})
    moa_z_loss: Optional[float] = field(default=None, metadata={"help": "router z-loss weight"})
    moa_cv_loss: Optional[float] = field(default=None, metadata={"help": "CV² load loss weight"})
