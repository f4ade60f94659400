"""HeadAttention against fairseq's stock MultiheadAttention (same weights), and head masking."""
import pytest
import torch

pytest.importorskip("fairseq")
from fairseq.modules.multihead_attention import MultiheadAttention  # noqa: E402

from hprune_fairseq.heads import HeadAttention  # noqa: E402

E, H, T, S, B = 32, 4, 5, 7, 3


def pair(**kwargs):
    torch.manual_seed(0)
    stock = MultiheadAttention(E, H, **kwargs)
    ours = HeadAttention(E, H, **kwargs)
    ours.load_state_dict(stock.state_dict())
    return stock.eval(), ours.eval()


def padding(batch, length):
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, -2:] = True  # the first sentence is shorter
    return mask


def causal(length):
    return torch.triu(torch.full((length, length), float("-inf")), 1)


@pytest.mark.parametrize("need_head_weights", [False, True])
def test_self_attention_equals_stock(need_head_weights):
    stock, ours = pair(self_attention=True)
    x = torch.randn(T, B, E)
    kpm = padding(B, T)
    for kwargs in ({"key_padding_mask": kpm}, {"attn_mask": causal(T)}, {"key_padding_mask": kpm, "attn_mask": causal(T)}):
        fast_out, _ = stock(x, x, x, need_weights=False, **kwargs)  # F.multi_head_attention_forward
        stock.skip_embed_dim_check = True  # stock's Python path: the only one that honours need_head_weights
        ref_out, ref_w = stock(x, x, x, need_weights=True, need_head_weights=need_head_weights, **kwargs)
        stock.skip_embed_dim_check = False
        torch.testing.assert_close(fast_out, ref_out, atol=1e-6, rtol=0)
        out, w = ours(x, x, x, need_weights=True, need_head_weights=need_head_weights, **kwargs)
        torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=0)
        torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=0)
        out_fast, none = ours(x, x, x, need_weights=False, **kwargs)  # the SDPA path
        assert none is None
        torch.testing.assert_close(out_fast, ref_out, atol=1e-6, rtol=0)


def test_encoder_decoder_attention_equals_stock():
    stock, ours = pair(encoder_decoder_attention=True, kdim=E, vdim=E)
    q, enc = torch.randn(T, B, E), torch.randn(S, B, E)
    kpm = padding(B, S)
    ref, ref_w = stock(q, enc, enc, key_padding_mask=kpm, static_kv=True, need_weights=True)
    out, w = ours(q, enc, enc, key_padding_mask=kpm, static_kv=True, need_weights=True)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=0)
    out, _ = ours(q, enc, enc, key_padding_mask=kpm, static_kv=True, need_weights=False)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("beam", [1, 3])
def test_incremental_decoding_equals_stock(beam):
    """Step-by-step decoding with cached keys/values, as beam search runs it (beams share encoder states)."""
    torch.manual_seed(1)
    stock_self, ours_self = pair(self_attention=True)
    stock_cross, ours_cross = pair(encoder_decoder_attention=True, kdim=E, vdim=E)
    for module in (stock_cross, ours_cross):
        module.set_beam_size(beam)
    enc = torch.randn(S, B, E).repeat_interleave(beam, dim=1)
    kpm = padding(B, S).repeat_interleave(beam, dim=0)
    states = {"stock": {}, "ours": {}}
    for step in range(4):
        x = torch.randn(1, B * beam, E)
        outs = {}
        for name, (self_attn, cross) in {"stock": (stock_self, stock_cross), "ours": (ours_self, ours_cross)}.items():
            state = states[name]
            h, _ = self_attn(x, x, x, incremental_state=state, need_weights=False)
            outs[name] = cross(h, enc, enc, key_padding_mask=kpm, incremental_state=state, static_kv=True,
                               need_weights=True)
        torch.testing.assert_close(outs["ours"][0], outs["stock"][0], atol=1e-6, rtol=0)
        torch.testing.assert_close(outs["ours"][1], outs["stock"][1], atol=1e-6, rtol=0)
        if step == 1:  # beam search reorders the hypotheses
            order = torch.arange(B * beam).flip(0) if beam == 1 else torch.arange(B * beam).view(B, beam).flip(1).reshape(-1)
            for self_attn, cross, state in ((stock_self, stock_cross, states["stock"]), (ours_self, ours_cross, states["ours"])):
                self_attn.reorder_incremental_state(state, order)
                cross.reorder_incremental_state(state, order)


def test_masked_head_contributes_exactly_zero():
    _, ours = pair(self_attention=True)
    x = torch.randn(T, B, E)
    ours.record_weights = ours.record_outputs = True
    full, _ = ours(x, x, x, need_weights=False)
    context = ours.head_outputs.clone()
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    ours.set_head_mask(mask)
    masked, _ = ours(x, x, x, need_weights=False)
    # what head 1 added through out_proj, computed by hand from its recorded output
    w1 = ours.out_proj.weight[:, ours.head_dim:2 * ours.head_dim]
    head1 = torch.einsum("btd,ed->tbe", context[:, 1], w1)
    torch.testing.assert_close(masked, full - head1, atol=1e-6, rtol=0)
    assert torch.count_nonzero(ours.head_outputs[:, 1]) == 0
    torch.testing.assert_close(ours.head_outputs[:, [0, 2, 3]], context[:, [0, 2, 3]], atol=0, rtol=0)


def test_all_heads_masked_leaves_only_the_bias():
    _, ours = pair(self_attention=True)
    ours.set_head_mask(torch.zeros(H))
    out, _ = ours(*(torch.randn(T, B, E),) * 3, need_weights=False)
    torch.testing.assert_close(out, ours.out_proj.bias.expand(T, B, E), atol=0, rtol=0)


def test_head_mask_shape_is_checked():
    _, ours = pair(self_attention=True)
    with pytest.raises(ValueError, match="expected \\(4,\\)"):
        ours.set_head_mask(torch.ones(3))


def test_recorded_head_outputs_carry_gradients():
    _, ours = pair(self_attention=True)
    ours.record_weights = ours.record_outputs = True
    x = torch.randn(T, B, E)
    out, _ = ours(x, x, x, need_weights=False)
    ours.head_outputs.retain_grad()
    out.pow(2).sum().backward()
    assert ours.head_outputs.grad is not None and ours.head_outputs.grad.shape == (B, H, T, E // H)
    assert ours.head_weights.shape == (B, H, T, T)
    torch.testing.assert_close(ours.head_weights.sum(-1), torch.ones(B, H, T))
