"""A CTranslate2 model directory built from an hprune model (physically pruned or not), so that a pruned model
runs where people deploy translation models.

CTranslate2 holds one head count per stack: every encoder layer has the same number of heads, and every decoder
layer the same number in its self- and cross-attention; each head has an explicit `head_dim`. A model whose
layers kept different numbers of heads is written with each sublayer padded by zero heads up to the largest
count of its stack: a zero head's queries, keys and values are 0 and its out_proj columns are 0, so it adds
exactly nothing (the scores are those of the model under its mask). `surviving_macs` says how much of the
pruning the padded model keeps.

Written from the model's modules, not through CTranslate2's fairseq converter (which does not know the
`hprune_transformer` architecture): pre/post-norm per side, activation, embedding scale, shared or separate
embeddings, layernorm_embedding, the position tables as weights (fairseq's, learned, or Marian's sinusoids),
Marian's decoder start vector and output bias, and the vocabularies in the model's order.

The attention CTranslate2 returns (`return_attention`, and `replace_unknowns` through it) is fairseq's: the last
decoder layer's cross-attention averaged over the heads that layer keeps.

The export is checked against hprune (`check_parity`): the log-probabilities it gives reference translations
(those of hprune's model, as fp32 rounding allows), and its beam search against fairseq's, where the two
runtimes differ by design in two places only: at the length limit (fairseq forces and scores an end of sentence
there, CTranslate2 stops without one, and fairseq applies its batch's longest limit to every sentence of the
batch) and in how eos is kept out of the first `min_len` steps (CTranslate2 masks it before the softmax, so the
other tokens' probabilities are renormalised; fairseq after, so they are not: the hypotheses' scores shift, by
a constant at min_len 1 and by one that depends on the prefix beyond, which can change the pick and the search).
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch
from omegaconf import OmegaConf

from ..attention_types import ATTENTION_TYPES, FFN_TYPES, STACK
from ..errors import UserError
from ..files import build_once, write_atomic
from ..flops import mask_macs
from ..rundir import RunDir
from . import register_exporter

# quantization=: CTranslate2's weight types; none keeps the weights as they are (float32)
QUANTIZATIONS = ("none", "float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16",
                 "bfloat16")
ACTIVATIONS = ("relu", "gelu", "gelu_accurate", "gelu_fast", "swish")


def import_ctranslate2(needs: str = "format=ctranslate2"):
    """The ctranslate2 package, or a one-line UserError saying what `needs` it and how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise UserError(f"{needs} needs the ctranslate2 package: pip install 'hprune[deploy]'") from None
    return ctranslate2


def check_quantization(quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise UserError(f"quantization={quantization} is not one of {', '.join(QUANTIZATIONS)}")


def check(cfg) -> None:
    check_quantization(cfg.quantization)


def stack_heads(model) -> Dict[str, int]:
    """The heads per layer of each CTranslate2 stack: the largest count left in its sublayers (at least 1)."""
    counts: Dict[str, List[int]] = {"encoder": [], "decoder": []}
    for attn_type, _, module in model.attention_modules():
        counts[STACK[attn_type]].append(module.num_heads)
    return {stack: max([1, *values]) for stack, values in counts.items()}


def padded_mask(mask: dict, heads: Dict[str, int]) -> dict:
    """The head mask the padded model computes: every sublayer of a stack with that stack's head count (its kept
    heads, then removed ones as zero heads), for counting the MACs the CTranslate2 model spends."""
    padded = {}
    for attn_type, rows in mask.items():
        if attn_type in FFN_TYPES:  # neurons: each layer's FFN keeps its own width
            padded[attn_type] = rows
            continue
        target = heads[STACK[attn_type]]
        padded[attn_type] = []
        for row in rows:
            extra = target - sum(row)
            new = list(row)
            for h, alive in enumerate(row):
                if not alive and extra > 0:
                    new[h], extra = 1, extra - 1
            padded[attn_type].append(new)
    return padded


def _np(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().float().cpu().numpy()


def _linear(spec, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    spec.weight = _np(weight)
    if bias is not None:
        spec.bias = _np(bias)


def _layer_norm(spec, module) -> None:
    spec.gamma, spec.beta = _np(module.weight), _np(module.bias)


def _padded_rows(proj, heads: int, head_dim: int):
    """q/k/v weight and bias with zero rows for the heads missing up to `heads`."""
    missing = heads * head_dim - proj.weight.size(0)
    weight = torch.cat([proj.weight.detach(), proj.weight.new_zeros(missing, proj.weight.size(1))])
    bias = None if proj.bias is None else torch.cat([proj.bias.detach(), proj.bias.new_zeros(missing)])
    return weight, bias


def _attention(spec, module, heads: int, self_attention: bool) -> None:
    D = module.head_dim
    q, k, v = (_padded_rows(p, heads, D) for p in (module.q_proj, module.k_proj, module.v_proj))

    def fused(parts):
        biases = [b for _, b in parts]
        return (torch.cat([w for w, _ in parts]),
                None if any(b is None for b in biases) else torch.cat(biases))
    if self_attention:
        _linear(spec.linear[0], *fused([q, k, v]))
    else:
        _linear(spec.linear[0], *q)
        _linear(spec.linear[1], *fused([k, v]))
    out = module.out_proj.weight.detach()
    out = torch.cat([out, out.new_zeros(out.size(0), heads * D - out.size(1))], dim=1)
    _linear(spec.linear[-1], out, module.out_proj.bias)


def alignment(decoder) -> Tuple[int, int]:
    """(layer, heads): the decoder layer whose cross-attention CTranslate2 returns and how many of its first
    heads it averages. fairseq's: the last layer, every head it has (in the padded model its kept heads come
    first; the zero heads after them attend uniformly and are left out). Where the last layer keeps no
    cross-attention head, fairseq returns no attention; CTranslate2 is given the last layer that keeps one."""
    for index in reversed(range(len(decoder.layers))):
        if decoder.layers[index].encoder_attn.num_heads:
            return index, decoder.layers[index].encoder_attn.num_heads
    return len(decoder.layers) - 1, 0  # no cross-attention anywhere: 0 is every (zero, uniform) head


def _positions(spec, module) -> None:
    if module.embed_positions is None:
        raise UserError("CTranslate2 needs position encodings; this model has none (--no-token-positional-embeddings)")
    positions = module.embed_positions
    table = positions.weight if isinstance(positions, torch.nn.Embedding) else positions.weights
    spec.encodings = _np(table)[positions.padding_idx + 1:]  # fairseq's first position is padding_idx + 1


def _vocabulary(dictionary) -> List[str]:
    return ["<blank>" if token == "<pad>" else token for token in dictionary.symbols]


def model_spec(model, model_cfg, source_dictionary, target_dictionary):
    """The CTranslate2 TransformerSpec of an hprune_transformer model (fp32 weights, heads padded per stack).
    model_cfg: the model settings its checkpoint records (its activation)."""
    import_ctranslate2()  # one line if it is not installed
    from ctranslate2.specs import transformer_spec

    refuse_what_ctranslate2_cannot_hold(model)
    activation = _activation(model_cfg)
    heads = stack_heads(model)
    encoder_spec = _encoder_spec(model.encoder, heads["encoder"], activation)
    decoder_spec = _decoder_spec(model.decoder, heads["decoder"], activation)
    spec = transformer_spec.TransformerSpec(encoder_spec, decoder_spec)
    _write_encoder(encoder_spec, model.encoder, heads["encoder"])
    _write_decoder(decoder_spec, model.decoder, heads["decoder"])
    spec.register_source_vocabulary(_vocabulary(source_dictionary))
    spec.register_target_vocabulary(_vocabulary(target_dictionary))
    spec.config.decoder_start_token = spec.config.eos_token  # fairseq's decoder input starts with eos
    spec.config.add_source_eos = True  # and its source ends with one
    return spec


def refuse_what_ctranslate2_cannot_hold(model) -> None:
    if list(model.moa_layers()):
        raise UserError("CTranslate2 has no mixture-of-attention-heads layer; export MoA models with format=fairseq")
    if model.mechanisms():
        names = ", ".join(m.name for m in model.mechanisms())
        raise UserError(f"this model still has its pruning mechanism ({names}); fold it first (`hprune export` of the "
                        "checkpoint does: model_spec is given the folded model)")


def _activation(model_cfg):
    """CTranslate2's activation for the one the model settings name (relu where they name none)."""
    from ctranslate2.specs import common_spec

    activation = getattr(model_cfg, "activation_fn", "relu")
    if activation not in ACTIVATIONS:
        raise UserError(f"CTranslate2 has no '{activation}' activation; it takes {', '.join(ACTIVATIONS)}")
    return {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU,
            "gelu_accurate": common_spec.Activation.GELUTanh, "gelu_fast": common_spec.Activation.GELUTanh,
            "swish": common_spec.Activation.SWISH}[activation]


def _projections(decoder) -> dict:
    """--decoder-input-dim / --decoder-output-dim give fairseq a projection on one side or both; CTranslate2 reads
    each one if its weights are there."""
    return {"project_in": decoder.project_in_dim, "project_out": decoder.project_out_dim}


def _encoder_spec(encoder, heads: int, activation):
    from ctranslate2.specs import transformer_spec

    return transformer_spec.TransformerEncoderSpec(
        len(encoder.layers), heads, pre_norm=encoder.layers[0].normalize_before,
        no_final_norm=encoder.layer_norm is None, activation=activation,
        layernorm_embedding=encoder.layernorm_embedding is not None, head_dim=encoder.layers[0].self_attn.head_dim)


def _decoder_spec(decoder, heads: int, activation):
    from ctranslate2.specs import transformer_spec

    alignment_layer, alignment_heads = alignment(decoder)
    return transformer_spec.TransformerDecoderSpec(
        len(decoder.layers), heads, pre_norm=decoder.layers[0].normalize_before,
        no_final_norm=decoder.layer_norm is None, activation=activation,
        layernorm_embedding=decoder.layernorm_embedding is not None,
        project_in_out=any(m is not None for m in _projections(decoder).values()), alignment_layer=alignment_layer,
        alignment_heads=alignment_heads, head_dim=decoder.layers[0].self_attn.head_dim)


def _write_encoder(spec, encoder, heads: int) -> None:
    _stack_ends(spec, spec.embeddings[0], encoder, encoder.embed_tokens.weight)
    for layer_spec, layer in zip(spec.layer, encoder.layers):
        _attention(layer_spec.self_attention, layer.self_attn, heads, self_attention=True)
        _layer_norm(layer_spec.self_attention.layer_norm, layer.self_attn_layer_norm)
        _ffn(layer_spec.ffn, layer)


def _write_decoder(spec, decoder, heads: int) -> None:
    from ctranslate2.specs.model_spec import OPTIONAL

    _stack_ends(spec, spec.embeddings, decoder, _decoder_embedding(decoder))
    for name, module in _projections(decoder).items():
        if module is not None:
            _linear(getattr(spec, name), module.weight, module.bias)
        elif hasattr(spec, name):  # the other side's projection only: this one is left out of the model
            setattr(spec, name, OPTIONAL)
    _linear(spec.projection, decoder.output_projection.weight, decoder.output_projection.bias)
    for layer_spec, layer in zip(spec.layer, decoder.layers):
        _attention(layer_spec.self_attention, layer.self_attn, heads, self_attention=True)
        _layer_norm(layer_spec.self_attention.layer_norm, layer.self_attn_layer_norm)
        _attention(layer_spec.attention, layer.encoder_attn, heads, self_attention=False)
        _layer_norm(layer_spec.attention.layer_norm, layer.encoder_attn_layer_norm)
        _ffn(layer_spec.ffn, layer)


def _decoder_embedding(decoder) -> torch.Tensor:
    """The decoder's token embeddings; Marian's start vector in eos's row: the decoder's first input, eos never
    comes again as input."""
    embedding = decoder.embed_tokens.weight.detach().clone()
    start = getattr(decoder.embed_tokens, "start", None)
    if start is not None:
        embedding[decoder.embed_tokens.start_index] = start.detach()
    return embedding


def _stack_ends(spec, embeddings_spec, module, embedding: torch.Tensor) -> None:
    """What a stack has besides its layers: token embeddings and their scale, positions, layernorm_embedding,
    the final layer norm of a pre-norm stack."""
    embeddings_spec.weight = _np(embedding)
    spec.scale_embeddings = float(module.embed_scale)
    _positions(spec.position_encodings, module)
    if module.layernorm_embedding is not None:
        _layer_norm(spec.layernorm_embedding, module.layernorm_embedding)
    if module.layer_norm is not None:
        _layer_norm(spec.layer_norm, module.layer_norm)


def _ffn(spec, layer) -> None:
    """CTranslate2 reads each layer's FFN width from its weights, but refuses a width of 0: a layer left with no
    neuron is written with one zero neuron, which adds exactly nothing (fc2's bias stays, as in fairseq)."""
    _layer_norm(spec.layer_norm, layer.final_layer_norm)
    fc1, fc2 = layer.fc1, layer.fc2
    if fc1.out_features:
        _linear(spec.linear_0, fc1.weight, fc1.bias)
        _linear(spec.linear_1, fc2.weight, fc2.bias)
    else:
        _linear(spec.linear_0, fc1.weight.new_zeros(1, fc1.in_features),
                None if fc1.bias is None else fc1.weight.new_zeros(1))
        _linear(spec.linear_1, fc2.weight.new_zeros(fc2.out_features, 1), fc2.bias)


def save(spec, dest, quantization: str) -> None:
    """Validate, quantize and write the model files into `dest` (an existing, empty folder)."""
    spec.validate()
    spec.optimize(quantization=None if quantization == "none" else quantization)
    spec.save(str(dest))


# A step of data/processing.py (what `hprune data prepare` ran on the source text before its subwords), as the
# README's program writes it with the same libraries: (lines of set-up, the line's transformation)
_STEPS = {
    "moses": (["normalizer = sacremoses.MosesPunctNormalizer(lang={lang!r}, pre_replace_unicode_punct=True, "
               "post_remove_control_chars=True)", "moses = sacremoses.MosesTokenizer(lang={lang!r})"],
              "line = moses.tokenize(normalizer.normalize(line), aggressive_dash_splits=True, return_str=True, "
              "escape=True)"),
    "moses_plain": (["moses = sacremoses.MosesTokenizer(lang={lang!r})"],
                    "line = moses.tokenize(line, return_str=True, escape=True)"),
    "normalize": (["normalizer = sacremoses.MosesPunctNormalizer(lang={lang!r}, pre_replace_unicode_punct=True, "
                   "post_remove_control_chars=True)"], 'line = " ".join(normalizer.normalize(line).split())'),
    "lowercase": ([], "line = line.lower()"),
}


def readme(data, subword_files: List[str], quantization: str, prefixes: Tuple[Optional[str], Optional[str]],
           text_step: Optional[str], generation, max_length: int) -> str:
    """How to use the directory: a Python program that turns text into the model's tokens as `hprune data
    prepare` did (`text_step`, then the subword files: the source's first), translates with the export's beam
    settings (one length limit, `max_length`, for every sentence: fairseq's is max_len_a · |source| +
    max_len_b), and turns the tokens back into text as hprune scores it (BPE removed, Moses detokenized)."""
    src, tgt = data.src_lang, data.tgt_lang
    moses = data.get("tokenizer") == "moses" or any(step.startswith("moses") or step == "normalize"
                                                     for step in (text_step or "").split("+"))
    imports, setup, encode = ["import ctranslate2"] + (["import sacremoses"] if moses else []), [], []
    for step in (text_step or "").split("+"):
        if step:
            lines, code = _STEPS[step]
            setup += [line.format(lang=src) for line in lines if line.format(lang=src) not in setup]
            encode.append(code)
    if data.get("bpe") == "sentencepiece":
        imports.append("import sentencepiece")
        setup.append(f"sp = sentencepiece.SentencePieceProcessor(model_file={subword_files[0]!r})")
        encode.append("tokens = sp.encode(line.strip(), out_type=str)")
    elif subword_files:  # BPE codes (fastBPE's are written in subword-nmt's format: the same merges)
        imports.append("from subword_nmt.apply_bpe import BPE")
        setup += [f"with open({subword_files[0]!r}, encoding='utf-8') as codes:", "    bpe = BPE(codes)"]
        encode.append("tokens = bpe.segment(line.strip()).split()")
    else:
        encode.append("tokens = line.split()  # the text in the model's own tokens (the synthetic task: its pieces/)")
    source_prefix, target_prefix = prefixes
    if source_prefix:  # a multilingual model: its language tokens, as its tokenizer and generate() place them
        encode.append(f"tokens = [{source_prefix!r}] + tokens  # the source language's token first")
    post_process = data.get("post_process")
    decode = {"sentencepiece": ['text = "".join(tokens).replace("\u2581", " ").strip()'],
              "subword_nmt": ['text = (" ".join(tokens) + " ").replace("@@ ", "").rstrip()']}.get(
        post_process, ['text = " ".join(tokens)'])
    if data.get("tokenizer") == "moses":
        setup.append(f"detokenizer = sacremoses.MosesDetokenizer(lang={tgt!r})")
        decode.append("text = detokenizer.detokenize(text.split())")
    options = (f"beam_size={generation.beam}, length_penalty={generation.lenpen},\n                                     "
               f"min_decoding_length={generation.min_len}, max_decoding_length={max_length}")
    if target_prefix:
        options += f",\n                                     target_prefix=[[{target_prefix!r}]] * len(lines)"
    # the target language's token starts each translation; wherever else the model says it, it is no word either
    # (hprune's text drops it too, as transformers' skip_special_tokens does)
    hypothesis = f"[t for t in result.hypotheses[0] if t != {target_prefix!r}]" if target_prefix else "result.hypotheses[0]"
    body = "\n".join(
        ["\n".join(imports), "",
         f'lines = ["A sentence to translate."]  # the {src} text, one sentence a string',
         "translator = ctranslate2.Translator('.', device='cpu')  # run here; device='cuda', compute_type='float16'",
         *setup, "", "", "def encode(line):", *[f"    {code}" for code in encode], "    return tokens", "", "",
         "def decode(tokens):", *[f"    {code}" for code in decode], "    return text", "", "",
         f"results = translator.translate_batch([encode(line) for line in lines], {options})",
         f"translations = [decode({hypothesis}) for result in results]" +
         ("  # without the target language's token" if target_prefix else ""),
         'print("\\n".join(translations))'])
    return (f"# A CTranslate2 model ({src} -> {tgt}, weights {quantization}) written by `hprune export`\n\n"
            "Translate with CTranslate2 alone (pip install ctranslate2"
            + "".join(f" {name}" for name, used in (("sacremoses", "sacremoses" in body),
                                                    ("sentencepiece", "sentencepiece" in body),
                                                    ("subword-nmt", "subword_nmt" in body)) if used)
            + "), in this folder: the source text goes through what `hprune data prepare` did to it, and the "
            "translations come back as hprune scores them.\n\n"
            f"```python\n{body}\n```\n\n"
            f"Subword files: {', '.join(subword_files) or 'none (the text is given in the model tokens)'}.\n")


def length_limits(sources: Sequence[Sequence[str]], generation, max_positions: int) -> List[int]:
    """fairseq's length limit of each sentence: max_len_a · |source + eos| + max_len_b, at most the decoder's
    positions less one (fairseq applies the longest source's limit to its whole batch: the one place the two
    can differ)."""
    return [min(int(generation.max_len_a * (len(source) + 1) + generation.max_len_b), max_positions - 1)
            for source in sources]


def _prefixed(prefix: Optional[str], count: int) -> dict:
    """translate_batch's target_prefix: a multilingual model's target language token, which its translations
    start with (and keep, as hprune's do)."""
    return {"target_prefix": [[prefix]] * count} if prefix else {}


def translate(model_dir: str, sources: List[List[str]], generation, limits: List[int], device: str = "cpu",
              threads: int = 0, prefix: Optional[str] = None) -> List[List[str]]:
    """Beam search in CTranslate2 with hprune's generation settings: beam, length penalty, minimum length and
    each sentence's length limit (`limits`), from the target `prefix` where there is one. Sentences that share a
    limit are translated in one call. The best hypothesis of each, as target symbols."""
    translator = import_ctranslate2().Translator(model_dir, device=device, intra_threads=threads)
    hypotheses: List[List[str]] = [[] for _ in sources]
    for length in sorted(set(limits)):
        ids = [i for i, n in enumerate(limits) if n == length]
        results = translator.translate_batch([sources[i] for i in ids], beam_size=generation.beam,
                                             length_penalty=generation.lenpen, min_decoding_length=generation.min_len,
                                             max_decoding_length=length, max_batch_size=64,
                                             **_prefixed(prefix, len(ids)))
        for i, result in zip(ids, results):
            hypotheses[i] = result.hypotheses[0]
    return hypotheses


def score(model_dir: str, pairs: Sequence[Tuple[List[str], List[str]]], device: str = "cpu",
          threads: int = 0) -> List[List[float]]:
    """CTranslate2's teacher-forced log-probability of each target token, the final eos's included."""
    translator = import_ctranslate2().Translator(model_dir, device=device, intra_threads=threads)
    results = translator.score_batch([list(s) for s, _ in pairs], [list(t) for _, t in pairs], max_batch_size=64)
    return [list(result.log_probs) for result in results]


class Reference(Protocol):
    """hprune's model as the export is checked against it (an Evaluator, its session under the export's mask)."""

    def score_pairs(self, pairs: List[Tuple[List[str], List[str]]]) -> List[List[float]]: ...

    def translate_each(self, sources: List[List[str]], generation) -> List[List[str]]: ...


@dataclass
class Parity:
    """The export's beam search against hprune's on one split, sentence by sentence (target symbols)."""
    exact: bool  # hprune's model runs in fp32, as the export does: the checks below apply in full
    ended: int = 0  # both translations end before the sentence's length limit
    ended_differ: int = 0
    min_len: int = 0  # ... differ, and agree once neither keeps eos out of the first steps (min_len 0)
    ties: int = 0  # ... differ, and what they pick without it scores the same (rounding breaks the tie)
    at_limit: int = 0  # either translation reaches the limit, where the runtimes differ by design
    at_limit_differ: int = 0
    max_log_prob_diff: float = 0.0  # largest |log p| difference, reference and differing translations
    unexplained: List[int] = field(default_factory=list)  # sentence indices

    SCORE_TOLERANCE = 1e-4  # two finished hypotheses this close are a tie that rounding breaks either way

    @property
    def log_prob_tolerance(self) -> float:
        """fp32 on both sides: rounding; fp16/bf16 on hprune's side: a bound only a wrong weight exceeds."""
        return 1e-3 if self.exact else 0.5

    def metrics(self) -> dict:
        return {"parity_ended": self.ended, "parity_ended_differ": self.ended_differ,
                "parity_ended_differ_min_len": self.min_len, "parity_ended_differ_tie": self.ties,
                "parity_at_limit": self.at_limit, "parity_at_limit_differ": self.at_limit_differ,
                "parity_max_log_prob_diff": float(f"{self.max_log_prob_diff:.3g}")}

    def describe(self) -> str:
        why = (f" ({self.min_len} by how each runtime keeps eos out of the first min_len steps, {self.ties} a tie)"
               if self.exact else " (hprune ran in half precision: not classified)")
        return (f"of {self.ended} translations that end before the length limit {self.ended_differ} differ"
                + (why if self.ended_differ else "") + f", of {self.at_limit} that reach it {self.at_limit_differ}")

    def failure(self) -> Optional[str]:
        """What makes the export wrong, in one line; None when it computes what hprune computes."""
        if self.max_log_prob_diff > self.log_prob_tolerance:
            return (f"the CTranslate2 export gives other log-probabilities than hprune's model (largest difference "
                    f"{self.max_log_prob_diff:.2g}, above {self.log_prob_tolerance:g})")
        if self.unexplained:
            shown = ", ".join(map(str, self.unexplained[:5])) + (" ..." if len(self.unexplained) > 5 else "")
            return (f"{len(self.unexplained)} of the CTranslate2 export's translations differ from hprune's before the "
                    f"length limit for no reason the two runtimes explain (sentences {shown})")
        return None


def normalised(log_probs: Sequence[float], lenpen: float) -> float:
    """A finished hypothesis's beam-search score in both runtimes: its log-probability (eos included) over its
    length with eos to the power lenpen."""
    return sum(log_probs) / len(log_probs) ** lenpen


def check_parity(model_dir: str, sources: List[List[str]], ours: List[List[str]], generation, limits: List[int],
                 references: Sequence[Tuple[List[str], List[str]]], hprune: Reference, exact: bool,
                 device: str = "cpu", threads: int = 0, prefix: Optional[str] = None) -> Tuple[List[List[str]], Parity]:
    """Translate `sources` with the float32 export at `model_dir` and set its translations against hprune's
    (`ours`, target symbols), sentence by sentence, those that reach the length limit apart from those that end
    before it. The log-probabilities of the `references` and of every translation that differs are compared
    with hprune's. A translation that differs before the limit is explained when the two runtimes agree on it
    once neither keeps eos out of the first steps (min_len 0, one sentence at a time, each with its own
    limit: the other design difference), or when what they then pick scores the same to SCORE_TOLERANCE (a
    tie, which rounding breaks either way). exact: hprune's model runs in fp32 (otherwise nothing is
    classified, as half precision alone can part the searches). prefix: the target language token both
    runtimes start from (a multilingual model). Returns the export's translations and the Parity."""
    theirs = translate(model_dir, sources, generation, limits, device, threads, prefix)
    parity = Parity(exact)
    differ = []
    for i, (mine, other) in enumerate(zip(ours, theirs)):
        if max(len(mine), len(other)) >= limits[i]:
            parity.at_limit += 1
            parity.at_limit_differ += mine != other
        else:
            parity.ended += 1
            if mine != other:
                differ.append(i)
    parity.ended_differ = len(differ)
    pairs = list(references) + [(sources[i], hypothesis) for i in differ for hypothesis in (ours[i], theirs[i])]
    for mine, other in zip(hprune.score_pairs(pairs), score(model_dir, pairs, device, threads)):
        parity.max_log_prob_diff = max(parity.max_log_prob_diff, max(abs(a - b) for a, b in zip(mine, other)))
    if differ and exact:
        unmasked = OmegaConf.merge(generation, {"min_len": 0})
        retried = [sources[i] for i in differ]
        again = list(zip(hprune.translate_each(retried, unmasked),
                         translate(model_dir, retried, unmasked, [limits[i] for i in differ], device, threads, prefix)))
        parted = [(i, pair) for i, pair in zip(differ, again) if pair[0] != pair[1]]
        scores = hprune.score_pairs([(sources[i], hypothesis) for i, pair in parted for hypothesis in pair])
        for n, (i, _) in enumerate(parted):
            mine, other = (normalised(log_probs, generation.lenpen) for log_probs in scores[2 * n:2 * n + 2])
            if abs(mine - other) > Parity.SCORE_TOLERANCE:
                parity.unexplained.append(i)
            else:
                parity.ties += 1
        parity.min_len = len(differ) - len(parted)
    return theirs, parity


def sentences_per_s(model_dirs: Dict[str, str], sources: List[List[str]], beam: int, threads: int = 0,
                    rounds: int = 2, device: str = "cpu", lengths: Tuple[Optional[int], ...] = (None,),
                    prefix: Optional[str] = None, max_length: int = 256, min_seconds: float = 0.0,
                    every: Optional[dict] = None) -> Dict[Optional[int], Dict[str, float]]:
    """Beam-search sentences/s of each CTranslate2 model directory on the same tokenized sources, measured
    alternately `rounds` times each after a warm-up (the best round: the least disturbed by the machine), for
    each of `lengths` ({length: {model: sentences/s}}; each model loaded once). A length: every hypothesis
    decoded to exactly that many tokens, so that the models do the same steps (a pruned model that stops later,
    or loops to the limit, is otherwise slower for what it says, not for what it is); None: as the model
    decodes, up to `max_length` tokens (CTranslate2's default, 256, or fewer for a model with fewer positions).
    prefix: the target language token translations start from (a multilingual model). min_seconds: each timing
    translates the sources again until it has lasted this long (a small model's batch takes milliseconds, within
    the machine's noise). every: a dict that gets each round's sentences/s ({length: {model: [per round]}}), for
    the spread of the timings."""
    ctranslate2 = import_ctranslate2()
    translators = {name: ctranslate2.Translator(path, device=device, intra_threads=threads)
                   for name, path in model_dirs.items()}
    for translator in translators.values():
        translator.translate_batch(sources[:8], beam_size=beam, max_decoding_length=max_length,
                                   **_prefixed(prefix, len(sources[:8])))
    speed = {}
    for length in lengths:
        fixed = forced(length, max_length, prefix, len(sources))
        timings: Dict[str, List[float]] = {name: [] for name in translators}
        for _ in range(rounds):
            for name, translator in translators.items():
                timings[name].append(timed_sentences_per_s(translator, sources, beam, fixed, min_seconds))
        speed[length] = {name: round(max(values), 2) for name, values in timings.items()}
        if every is not None:
            every[length] = timings
    return speed


def forced(length: Optional[int], max_length: int, prefix: Optional[str], count: int) -> dict:
    """translate_batch's arguments decoding every hypothesis to exactly `length` tokens (None: as the model
    decodes, up to max_length), from the target language token `prefix` (a multilingual model)."""
    fixed = {"max_decoding_length": max_length} if length is None else \
        {"min_decoding_length": length, "max_decoding_length": length}
    return {**fixed, **_prefixed(prefix, count)}


def timed_sentences_per_s(translator, sources: List[List[str]], beam: int, fixed: dict, min_seconds: float) -> float:
    """One timing: the sources translated (again, until min_seconds have passed), sentences per second."""
    import time

    started, done = time.perf_counter(), 0
    while not done or time.perf_counter() - started < min_seconds:
        translator.translate_batch(sources, beam_size=beam, max_batch_size=64, **fixed)
        done += len(sources)
    return done / (time.perf_counter() - started)


PARITY_REFERENCES = 200  # reference translations whose log-probabilities the export is checked on


@register_exporter("ctranslate2", check=check)
def export(evaluator, mask: dict, out: Path, cfg) -> dict:
    """A CTranslate2 model directory with the model's subword files and a README, checked against hprune's model
    under the mask before it is kept (check_parity), its speed measured against the unpruned model's."""
    dest = out / "ctranslate2"
    metrics, parity, sentences, prefix = checked_export(evaluator, mask, dest, out, cfg)
    speed, length = speed_against_unpruned(evaluator, dest, cfg, prefix)  # (the pruned fp32 copy freed by now)
    metrics.update(speed_metrics(speed, length))
    print(summary(metrics, dest, cfg, sentences, parity))
    return metrics


def checked_export(evaluator, mask: dict, dest: Path, out: Path, cfg) -> Tuple[dict, "Parity", int, Optional[str]]:
    """The export written into `dest` and checked (export), both runtimes' translations saved in `out`: its
    metrics, Parity, the sentences checked and the target language token translations start from."""
    session = evaluator.session
    model = session.pruned_copy(mask)
    model_spec(model, session.model_config, *session.dictionaries)  # what it cannot hold: refused now
    layout = layout_metrics(evaluator, model, mask, dest, cfg)
    del model  # made again where it is written: never beside a CTranslate2 model (NLLB-1.3B: 5.5 GB each)

    def spec_of_pruned():
        return model_spec(session.pruned_copy(mask), session.model_config, *session.dictionaries)

    shutil.rmtree(dest, ignore_errors=True)  # an export run again into the same run dir is written anew
    subwords = session.prepared.subword_files()
    checked_on = CheckedSplit.of(session, cfg)
    with session.masked(mask):  # hprune's beam search on the masked model, the same split and settings
        masked, hprune_quality = evaluator.translate()  # (BLEU only: no validation loss needed here)
    built = {}

    def build(staging: Path) -> None:
        built["translations"], built["parity"] = write_checked_model(staging, evaluator, mask, spec_of_pruned, cfg,
                                                                     checked_on, masked.symbols)
        write_usage(staging, session, subwords, cfg)

    build_once(dest, "README.md", build)
    parity = built["parity"]
    theirs, quality = evaluator.score_symbols(built["translations"], cfg.split)
    run = RunDir(out)  # both runtimes' translations of the split, beside each other
    run.save_hypotheses("hprune", masked.hypotheses, evaluator.references(cfg.split, len(theirs)))
    run.save_hypotheses("ctranslate2", theirs, [])
    metrics = {"split": cfg.split, "bleu": quality.bleu, "bleu_hprune": hprune_quality.bleu,
               "bleu_signature": quality.bleu_signature,
               "translations_differ": sum(a != b for a, b in zip(theirs, masked.hypotheses)), **parity.metrics(),
               **layout, "subword_files": [p.name for p in subwords],
               "speed_split": cfg.speed_split}
    return metrics, parity, len(theirs), checked_on.prefix


@dataclass(frozen=True)
class CheckedSplit:
    """The split an export is checked on: its sources in the model's tokens, each sentence's length limit
    (length_limits), and the target language token translations start from (a multilingual model's, or None)."""
    sources: List[List[str]]
    limits: List[int]
    prefix: Optional[str]

    @classmethod
    def of(cls, session, cfg) -> "CheckedSplit":
        prefix = session.prefixes[1]
        sources = session.source_tokens(cfg.split)
        return cls(sources, length_limits(sources, cfg.generation, session.max_target_positions), prefix)


def write_checked_model(staging: Path, evaluator, mask: dict, spec_of: Callable[[], object], cfg, split: CheckedSplit,
                        ours: List[List[str]]) -> Tuple[List[List[str]], Parity]:
    """The float32 model (spec_of(): its spec, made anew for each writing, freed once written) written into
    `staging` and checked against hprune's under the mask (`ours`: its translations, as target symbols) before
    anything is kept; then, where a quantization is asked for, written again quantized. Returns the kept model's
    translations and the float32 model's Parity."""
    session = evaluator.session
    save(spec_of(), staging, "none")
    with session.masked(mask):
        translations, parity = check_parity(
            str(staging), split.sources, ours, cfg.generation, split.limits,
            session.sentence_pairs(cfg.split, PARITY_REFERENCES), evaluator,
            exact=cfg.precision == "fp32", device=session.device, threads=cfg.threads, prefix=split.prefix)
    failure = parity.failure()
    if failure:
        raise UserError(f"{failure}; nothing was written (docs/deploy.md, 'Checked on every export')")
    if cfg.quantization not in ("none", "float32"):
        for path in staging.iterdir():
            path.unlink()
        save(spec_of(), staging, cfg.quantization)
        translations = translate(str(staging), split.sources, cfg.generation, split.limits, session.device,
                                 cfg.threads, split.prefix)
    return translations, parity


def write_usage(staging: Path, session, subwords: List[Path], cfg) -> None:
    """The subword files beside the model, and the README that says how to use them with it."""
    for path in subwords:
        shutil.copy(path, staging / path.name)
    text_step = session.prepared.text_step()
    write_atomic(staging / "README.md",
                 readme(session.data, [p.name for p in subwords], cfg.quantization, session.prefixes, text_step,
                        cfg.generation, min(256, session.max_target_positions - 1)))


def speed_against_unpruned(evaluator, dest: Path, cfg, prefix: Optional[str]) -> Tuple[Dict[str, dict], int]:
    """Sentences/s in CTranslate2 of the export and of the unpruned model written the same way, on the speed split:
    as each decodes ("free", up to the generation settings' limit for the longest source, as hprune translates),
    and with every translation the sources' mean length ("fixed": the same decoding steps). Returns both and that
    length."""
    session = evaluator.session
    with tempfile.TemporaryDirectory() as unpruned:
        save(model_spec(session.pruned_copy(session.unpruned_mask()), session.model_config, *session.dictionaries),
             unpruned, cfg.quantization)
        models, sources = {"pruned": str(dest), "unpruned": unpruned}, session.source_tokens(cfg.speed_split)
        length = max(1, round(sum(map(len, sources)) / len(sources)))  # the sources' mean length
        measured = sentences_per_s(models, sources, cfg.generation.beam, cfg.threads, device=session.device,
                                   lengths=(None, length), prefix=prefix,
                                   max_length=min(256, max(length_limits(sources, cfg.generation,
                                                                         session.max_target_positions))))
    return {"free": measured[None], "fixed": measured[length]}, length


def layout_metrics(evaluator, model, mask: dict, dest: Path, cfg) -> dict:
    """The export's heads per stack, the layer and heads its attention is read from, and the attention MACs it
    spends (its padded heads included) beside the mask's."""
    heads = stack_heads(model)
    alignment_layer, alignment_heads = alignment(model.decoder)
    costs, unpruned_mask = evaluator.unit_costs(), evaluator.session.unpruned_mask()
    macs = {name: mask_macs(costs, m, ATTENTION_TYPES)
            for name, m in (("mask", mask), ("ctranslate2", padded_mask(mask, heads)), ("unpruned", unpruned_mask))}
    return {"export_dir": str(dest.absolute()), "quantization": cfg.quantization,
            "ctranslate2_encoder_heads": heads["encoder"], "ctranslate2_decoder_heads": heads["decoder"],
            "ctranslate2_alignment_layer": alignment_layer, "ctranslate2_alignment_heads": alignment_heads,
            "attention_macs_pct_mask": round(100 * macs["mask"] / macs["unpruned"], 2),
            "attention_macs_pct_ctranslate2": round(100 * macs["ctranslate2"] / macs["unpruned"], 2)}


def speed_metrics(speed: Dict[str, dict], length: int) -> dict:
    return {"sentences_per_s_ctranslate2": speed["free"]["pruned"],
            "sentences_per_s_ctranslate2_unpruned": speed["free"]["unpruned"],
            "speedup_ctranslate2": round(speed["free"]["pruned"] / speed["free"]["unpruned"], 3),
            "decoding_length_fixed": length,
            "speedup_ctranslate2_fixed_length": round(speed["fixed"]["pruned"] / speed["fixed"]["unpruned"], 3)}


def summary(m: dict, dest: Path, cfg, sentences: int, parity: Parity) -> str:
    return (f"CTranslate2 model: {dest} ({cfg.quantization}); BLEU {m['bleu']:.2f} on {cfg.split} (hprune, masked: "
            f"{m['bleu_hprune']:.2f}; {m['translations_differ']} of {sentences} translations differ: float32 "
            f"{parity.describe()}); heads per layer: encoder {m['ctranslate2_encoder_heads']}, decoder "
            f"{m['ctranslate2_decoder_heads']}; attention MACs {m['attention_macs_pct_ctranslate2']} % of the "
            f"unpruned model's (the mask's: {m['attention_macs_pct_mask']} %); {m['sentences_per_s_ctranslate2']} "
            f"sentences/s against the unpruned model's {m['sentences_per_s_ctranslate2_unpruned']} "
            f"({m['speedup_ctranslate2']}x, beam {cfg.generation.beam}, {cfg.speed_split} split), "
            f"{m['speedup_ctranslate2_fixed_length']}x with every translation {m['decoding_length_fixed']} tokens long "
            "(the same decoding steps)")
