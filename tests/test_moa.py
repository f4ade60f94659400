"""MoA attention (hprune_fairseq.moa) against references written differently, its losses against closed forms,
and the hprune_moa model's incremental decoding against full-sequence decoding."""
import argparse
import json
import math
import types

import pytest
import torch

pytest.importorskip("fairseq")
from hprune_fairseq.moa import Dispatch, MoAAttention  # noqa: E402

C, T, S, B = 32, 5, 7, 3


def moa(experts, top_k, head_dim=8, seed=0, **kwargs):
    torch.manual_seed(seed)
    module = MoAAttention(C, experts, top_k, head_dim, **kwargs).eval()
    return module


def causal(length):
    return torch.triu(torch.full((length, length), float("-inf")), 1)


def reference(module, x, memory, probs_of, key_padding=None, attn_mask=None, query_padding=None):
    """Per token and per selected expert: softmax(q K^T / sqrt(d)) V, weighted and projected, summed."""
    keys = torch.einsum("sbc,dc->bsd", memory, module.k_proj.weight)
    values = torch.einsum("sbc,dc->bsd", memory, module.v_proj.weight)
    out = torch.zeros(B, x.size(0), C)
    for b in range(B):
        for t in range(x.size(0)):
            if query_padding is not None and query_padding[b, t]:
                continue
            p = probs_of(x[t, b])
            weights, chosen = p.topk(module.top_k)
            for w, e in zip(weights, chosen.tolist()):
                q = x[t, b] @ module.q_experts[e]
                scores = keys[b] @ q / math.sqrt(module.head_dim)
                if key_padding is not None:
                    scores = scores.masked_fill(key_padding[b], float("-inf"))
                if attn_mask is not None:
                    scores = scores + attn_mask[t]
                out[b, t] += w * (torch.softmax(scores, -1) @ values[b]) @ module.o_experts[e]
    return out.transpose(0, 1)


def test_dense_routing_with_uniform_router_equals_reference():
    """k = E with the zero-initialised router: every expert weighs 1/E, with causal and key-padding masks."""
    module = moa(4, 4, self_attention=True)
    x = torch.randn(T, B, C)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[0, :2] = True  # a left-padded sentence
    out, weights = module(x, x, x, key_padding_mask=kpm, attn_mask=causal(T), need_weights=True)
    uniform = lambda token: torch.full((4,), 0.25)  # noqa: E731
    expected = reference(module, x, x, uniform, key_padding=kpm, attn_mask=causal(T))
    seen = torch.ones(T, B, dtype=torch.bool)
    seen[:2, 0] = False  # sentence 0's pad positions: causal and padding masks leave them no key
    torch.testing.assert_close(out[seen], expected[seen], atol=1e-5, rtol=0)
    torch.testing.assert_close(weights.sum(-1)[seen.T], torch.ones(int(seen.sum())))
    fast, none = module(x, x, x, key_padding_mask=kpm, attn_mask=causal(T), need_weights=False)  # SDPA
    assert none is None
    torch.testing.assert_close(fast[seen], out[seen], atol=1e-5, rtol=0)


@pytest.mark.parametrize("renormalize", [False, True])
def test_sparse_routing_equals_per_token_reference(renormalize, dispatch_mode):
    """k < E with a random router, cross-attention over padded keys; pad queries get no expert (zero output)."""
    module = moa(6, 2, encoder_decoder_attention=True, renormalize=renormalize)
    torch.nn.init.normal_(module.router.weight)
    x, memory = torch.randn(T, B, C), torch.randn(S, B, C)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, -3:] = True
    qpm = torch.zeros(B, T, dtype=torch.bool)
    qpm[2, -2:] = True
    module.query_padding_mask = qpm

    def probs_of(token):
        p = torch.softmax(module.router.weight @ token, -1)
        if renormalize:  # the values of w / Σ_topk w (the gradient is tested separately)
            top = p.topk(2).values.sum()
            return p / (top + 1e-6)
        return p

    out, _ = module(x, memory, memory, key_padding_mask=kpm, static_kv=True, need_weights=False)
    expected = reference(module, x, memory, probs_of, key_padding=kpm, query_padding=qpm)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    assert torch.count_nonzero(out[-2:, 2]) == 0


def test_sparse_routing_gradients_equal_the_per_token_reference(dispatch_mode, monkeypatch):
    """Backward through the expert buffer (the jagged layout streamed in 7-row chunks that cut through the
    experts' groups, or the blocks) gives the per-token reference's gradients for the input, every projection
    and the router."""
    monkeypatch.setattr(Dispatch, "chunk_bytes", 7 * C * 4)  # 7 fp32 rows of d_model per chunk
    module = moa(6, 3, self_attention=True)
    torch.nn.init.normal_(module.router.weight)
    x = torch.randn(T, B, C, requires_grad=True)
    direction = torch.randn(T, B, C)
    out, _ = module(x, x, x, attn_mask=causal(T), need_weights=False)
    params = [x, module.q_experts, module.o_experts, module.router.weight, module.k_proj.weight]
    grads = torch.autograd.grad((out * direction).sum(), params)
    expected = reference(module, x, x, lambda token: torch.softmax(module.router.weight @ token, -1),
                         attn_mask=causal(T))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    for grad, reference_grad in zip(grads, torch.autograd.grad((expected * direction).sum(), params)):
        torch.testing.assert_close(grad, reference_grad, atol=1e-5, rtol=1e-4)
    if dispatch_mode == "jagged":
        experts = torch.softmax(x.detach().view(-1, C) @ module.router.weight.detach().T, -1).topk(3).indices
        plan = Dispatch.plan(experts, 6, (C * 4, 8 * 4))
        chunks = plan.chunks(torch.empty(0, C))
        assert len(chunks) == math.ceil(T * B * 3 / 7) and any(c[2].stop - c[2].start > 1 for c in chunks)
        assert Dispatch.plan(experts, 6, (C * 4, 6 * 4)).offsets is None  # 24-byte rows: grouped_mm can't, blocks


def test_renormalisation_denominator_carries_no_gradient():
    """w_i = p_i / stopgrad(Σ_topk p): Σ_i w_i is 1 in value, yet its gradient is ∇(Σ_topk p) / Σ_topk p, which
    is what a detached denominator gives (an attached one would give exactly zero)."""
    module = moa(6, 2, renormalize=True)
    torch.nn.init.normal_(module.router.weight)
    tokens = torch.randn(4, C)
    weights, experts, _, _ = module.route(tokens, None)
    torch.testing.assert_close(weights.sum(-1), torch.ones(4), atol=1e-5, rtol=0)
    weights.sum().backward()
    grad = module.router.weight.grad.clone()
    assert grad.abs().max() > 1e-3
    module.router.weight.grad = None
    probs = torch.softmax(module.router(tokens), -1)
    top = probs.gather(1, experts).sum(-1)
    (top / (top.detach() + 1e-6)).sum().backward()
    torch.testing.assert_close(grad, module.router.weight.grad)


def test_auxiliary_losses_match_closed_forms():
    """Two experts, one per token, a router built so that the routing probabilities are known exactly."""
    module = moa(2, 1, self_attention=True, switch_loss=1.0, z_loss=0.0)
    a = math.log(3.0)  # logits (a, 0): p = (3/4, 1/4); logits (0, a): p = (1/4, 3/4)
    with torch.no_grad():
        module.router.weight.copy_(torch.tensor([[a] + [0.0] * (C - 1), [0.0, a] + [0.0] * (C - 2)]))
    tokens = torch.zeros(3, C)
    tokens[0, 0] = tokens[1, 0] = tokens[2, 1] = 1.0  # two tokens go to expert 0, one to expert 1
    weights, experts, probs, logits = module.route(tokens, None)
    assert experts.flatten().tolist() == [0, 0, 1]
    importance = torch.tensor([3 / 4 + 3 / 4 + 1 / 4, 1 / 4 + 1 / 4 + 3 / 4]) / 3
    share = torch.tensor([2 / 3, 1 / 3])
    switch = 2 * (importance * share).sum()  # = 2 (7/12 · 2/3 + 5/12 · 1/3) = 19/18
    assert abs(float(switch) - 19 / 18) < 1e-6
    loss = module.auxiliary_loss(probs, logits, weights, experts, None)
    torch.testing.assert_close(loss, switch.float())
    module.switch_loss, module.z_loss = 0.0, 1.0
    z = math.log(math.exp(a) + 1) ** 2  # every token: logsumexp(a, 0)
    torch.testing.assert_close(module.auxiliary_loss(probs, logits, weights, experts, None), torch.tensor(z))
    module.z_loss, module.cv_loss = 0.0, 1.0
    gates = torch.tensor([3 / 4 + 3 / 4, 3 / 4])  # summed gate values per expert
    cv = gates.var() / gates.mean() ** 2
    torch.testing.assert_close(module.auxiliary_loss(probs, logits, weights, experts, None), cv)


def test_z_loss_does_not_overflow():
    """The released code's log(exp(logits).sum()) is inf here (exp(100) > fp32's max); logsumexp is not."""
    module = moa(4, 2, switch_loss=0.0, z_loss=1.0)
    logits = torch.full((3, 4), 100.0)
    assert torch.isinf(torch.log(torch.exp(logits).sum(-1))).all()
    probs = torch.softmax(logits, -1)
    weights, experts = probs.topk(2)
    loss = module.auxiliary_loss(probs, logits, weights, experts, None)
    torch.testing.assert_close(loss, torch.tensor((100 + math.log(4)) ** 2))


def test_pads_get_no_expert_and_leave_the_statistics_unchanged():
    module = moa(6, 2, self_attention=True)
    torch.nn.init.normal_(module.router.weight)
    x = torch.randn(T, B, C)
    module.record_routing = True
    module(x, x, x, need_weights=False)
    aux_without, slots_without = module.aux_loss.clone(), module.routing["slots"].clone()
    module.routing = None
    padded = torch.cat([x, torch.randn(2, B, C)])  # two pad positions appended to every sentence
    module.query_padding_mask = torch.zeros(B, T + 2, dtype=torch.bool)
    module.query_padding_mask[:, T:] = True
    kpm = module.query_padding_mask
    out, _ = module(padded, padded, padded, key_padding_mask=kpm, need_weights=False)
    assert module.routing["slots"].sum() == B * T * 2  # k slots per real token, none for pads
    torch.testing.assert_close(module.routing["slots"], slots_without)
    torch.testing.assert_close(module.aux_loss, aux_without)
    assert torch.count_nonzero(out[T:]) == 0


@pytest.mark.parametrize("top_k", [2, 4])
def test_masked_experts_leave_the_router_and_equal_physical_removal(top_k):
    module = moa(4, top_k, self_attention=True)
    torch.nn.init.normal_(module.router.weight)
    x = torch.randn(T, B, C)
    module.set_head_mask([1, 0, 1, 1])
    masked, _ = module(x, x, x, need_weights=False)
    module.record_routing = True
    module(x, x, x, need_weights=False)
    assert module.routing["slots"][1] == 0  # the masked expert gets no token
    module.record_routing, module.routing = False, None
    module.set_head_mask(None)
    module.keep_heads([0, 2, 3])
    assert module.num_heads == 3 and module.head_ids == [0, 2, 3] and module.router.weight.shape == (3, C)
    pruned, _ = module(x, x, x, need_weights=False)
    torch.testing.assert_close(pruned, masked, atol=1e-6, rtol=0)


@pytest.fixture(params=["jagged", "blocks"])
def dispatch_mode(request, monkeypatch):
    """Both layouts of the expert buffer: jagged groups (the CPU) and the padded blocks a device uses."""
    monkeypatch.setattr(Dispatch, "jagged_on_cpu", request.param == "jagged")
    return request.param


def test_every_expert_masked_adds_nothing_and_stays_finite():
    module = moa(4, 2, self_attention=True)
    x = torch.randn(T, B, C)
    module.set_head_mask([0, 0, 0, 0])
    out, _ = module(x, x, x, need_weights=False)
    assert torch.count_nonzero(out) == 0 and torch.isfinite(module.aux_loss)
    module.set_head_mask(None)
    module.keep_heads([])
    assert torch.count_nonzero(module(x, x, x, need_weights=False)[0]) == 0


@pytest.mark.parametrize("top_k", [2, 4])
def test_expert_gates_fold_exactly_and_train(top_k):
    """A closed gate takes its expert out of the router, an open one scales its output: folding the
    deterministic gates into W_o and a mask computes the gated module's test-time output; in training the
    gates are sampled and their log α get gradients."""
    module = moa(4, top_k, self_attention=True)
    torch.nn.init.normal_(module.router.weight)
    from hprune_fairseq.mechanisms.gates import add_gate
    add_gate(module)
    with torch.no_grad():
        module.gate.log_alpha.copy_(torch.tensor([3.0, -6.0, 0.2, -0.5]))  # open, closed, fractional, fractional
    values = module.gate.deterministic()
    assert values[0] == 1 and values[1] == 0 and 0 < values[2] < 1 and 0 < values[3] < 1
    x = torch.randn(T, B, C)
    gated, _ = module(x, x, x, need_weights=False)
    module.set_head_mask([1, 0, 1, 1])  # the closed expert masked: the same output (it was out of the router)
    torch.testing.assert_close(module(x, x, x, need_weights=False)[0], gated, atol=1e-6, rtol=0)
    module.set_head_mask(None)
    module.train()
    module(x, x, x, need_weights=False)[0].pow(2).sum().backward()
    assert module.gate.log_alpha.grad is not None and module.gate.log_alpha.grad.abs().sum() > 0
    module.eval()
    folded = module.fold_gate()
    torch.testing.assert_close(folded, values)
    assert module.gate is None and module.head_mask.tolist() == [True, False, True, True]
    torch.testing.assert_close(module(x, x, x, need_weights=False)[0], gated, atol=1e-6, rtol=0)


def test_dispatch_puts_every_slot_in_a_block_of_its_expert(dispatch_mode):
    torch.manual_seed(3)
    experts = torch.rand(50, 6).topk(3).indices
    plan = Dispatch.plan(experts, 6)
    rows = plan.row_of_slot.view(50, 3)
    if dispatch_mode == "blocks":
        block = plan.token_of_row.numel() // plan.blocks
        assert torch.equal(plan.block_expert[rows // block], experts)  # each slot sits in its expert's block
        assert (plan.token_of_row == 50).sum() == plan.blocks * block - 150  # the rest point at the zero row
    else:
        ends = plan.offsets.long()
        assert torch.equal(torch.searchsorted(ends, rows, right=True), experts)  # each slot in its expert's group
        assert ends[-1] == 150 and plan.token_of_row.numel() == 150
    assert torch.equal(plan.token_of_row[rows], torch.arange(50).unsqueeze(1).expand(50, 3))
    assert torch.equal(plan.slot_of_row[rows], torch.arange(150).view(50, 3))
    assert len(set(plan.row_of_slot.tolist())) == 150  # no two slots share a row


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="k <= E"):
        MoAAttention(C, 4, 5, 8)
    with pytest.raises(ValueError, match="head_dim"):
        MoAAttention(C, 4, 2, 0)
    with pytest.raises(ValueError, match="expected \\(4,\\)"):
        MoAAttention(C, 4, 2, 8).set_head_mask([1, 1])


def tiny_moa_model(**overrides):
    from fairseq.data import Dictionary
    from fairseq.models import ARCH_CONFIG_REGISTRY

    from hprune_fairseq.model import HpruneMoAModel

    dictionary = Dictionary()
    for i in range(20):
        dictionary.add_symbol(f"w{i}")
    task = types.SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    args = argparse.Namespace(
        arch="hprune_moa", encoder_embed_dim=C, encoder_ffn_embed_dim=64, encoder_layers=2, encoder_attention_heads=4,
        decoder_embed_dim=C, decoder_ffn_embed_dim=64, decoder_layers=2, decoder_attention_heads=4,
        share_all_embeddings=True, moa_experts=4, moa_top_k=2, moa_head_dim=8, dropout=0.0, **overrides)
    ARCH_CONFIG_REGISTRY["hprune_moa"](args)
    torch.manual_seed(0)
    model = HpruneMoAModel.build_model(args, task).eval()
    for _, _, module in model.moa_layers():
        torch.nn.init.normal_(module.router.weight)
    return model, dictionary


@pytest.mark.parametrize("types_", ["enc-self,dec-self,dec-enc", "dec-enc"])
def test_incremental_decoding_equals_full_decoding(types_):
    model, dictionary = tiny_moa_model(moa_types=types_)
    assert {kind for kind, _, _ in model.moa_layers()} == set(types_.split(","))
    src = torch.randint(4, 24, (3, 6))
    src[0, :2] = dictionary.pad()  # fairseq left-pads sources
    tgt = torch.randint(4, 24, (3, 5))
    tgt[:, 0] = dictionary.eos()
    with torch.no_grad():
        encoded = model.encoder(src, src_lengths=src.ne(dictionary.pad()).sum(1))
        full, _ = model.decoder(tgt, encoder_out=encoded)
        state, steps = {}, []
        for t in range(tgt.size(1)):
            if t == 3:  # beam search reorders hypotheses between steps
                order = torch.tensor([2, 0, 1])
                model.decoder.reorder_incremental_state_scripting(state, order)
                encoded = model.encoder.reorder_encoder_out(encoded, order)
                tgt, full, steps = tgt[order], full[order], [s[order] for s in steps]
            step, _ = model.decoder(tgt[:, :t + 1], encoder_out=encoded, incremental_state=state)
            steps.append(step)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


def test_model_sums_the_auxiliary_losses_of_its_layers():
    model, dictionary = tiny_moa_model(moa_types="enc-self,dec-self,dec-enc")
    src = torch.randint(4, 24, (3, 6))
    tgt = torch.randint(4, 24, (3, 5))
    model(src, src.ne(dictionary.pad()).sum(1), tgt)
    layers = [m.aux_loss for _, _, m in model.moa_layers()]
    assert len(layers) == 6 and all(loss is not None and loss > 0 for loss in layers)
    torch.testing.assert_close(model.moa_aux_loss(), sum(layers))


@pytest.mark.parametrize("top_k", [2, 4])
def test_recorded_expert_scale_gives_michel_importance(top_k):
    """Σ_t ∂L/∂ξ_{e,t} (what Michel importance sums, before the absolute value) equals ∂L/∂α for α scaling
    expert e's output projection everywhere: ⟨W_o^e, ∂L/∂W_o^e⟩."""
    module = moa(4, top_k, self_attention=True)
    torch.nn.init.normal_(module.router.weight)
    module.record_outputs = True
    x = torch.randn(T, B, C)
    out, _ = module(x, x, x, need_weights=False)
    assert module.head_outputs.shape == (B, 4, T, 1)
    loss = out.pow(2).sum()
    (scale_grad,) = torch.autograd.grad(loss, [module.head_outputs], retain_graph=True)
    loss.backward()
    per_expert = (module.o_experts * module.o_experts.grad).sum((1, 2))
    torch.testing.assert_close(scale_grad.sum((0, 2, 3)), per_expert, atol=1e-3, rtol=1e-4)
    if top_k == 2:  # an expert a token did not choose has no influence through it
        _, experts, _, _ = module.route(x.transpose(0, 1).reshape(-1, C), None)
        chosen = torch.zeros(B * T, 4, dtype=torch.bool).scatter(1, experts, True)
        unrouted = ~chosen.view(B, T, 4).permute(0, 2, 1)
        assert torch.count_nonzero(scale_grad.squeeze(-1)[unrouted]) == 0


@pytest.mark.parametrize("experts, top_k", [(4, 4), (6, 2)])
def test_counted_macs_match_the_closed_form(experts, top_k):
    """What `hprune eval` reports as MACs: per token, k queries and k outputs (k·d·D each), the shared K and V
    (d·D each), the router (d·E), and k·S·D each for the scores and the weighted values."""
    from hprune.flops import count_flops

    module = moa(experts, top_k, self_attention=True)
    torch.nn.init.normal_(module.router.weight)
    x = torch.randn(T, B, C)
    macs = count_flops(module, x, x, x, need_weights=False) / 2
    D = module.head_dim
    per_token = 2 * top_k * C * D + 2 * C * D + C * experts + 2 * top_k * T * D
    assert macs == T * B * per_token


def test_a_blocks_flops_are_written_even_when_it_fails(tmp_path):
    """flops_written_to (HPRUNE_FLOPS_TO for a CLI verb, the real-size bench): a matmul and a linear layer counted
    as their closed forms, 2·m·k·n each, written at the block's end, also when the block raises."""
    from hprune.flops import flops_written_to
    path = tmp_path / "flops.json"
    with flops_written_to(str(path)):
        torch.ones(3, 4) @ torch.ones(4, 5)
        torch.nn.Linear(5, 7)(torch.ones(2, 5))
    assert json.loads(path.read_text()) == {"flops": 2 * 3 * 4 * 5 + 2 * 2 * 5 * 7}
    with pytest.raises(ZeroDivisionError), flops_written_to(str(path)):
        torch.ones(2, 2) @ torch.ones(2, 2)
        1 / 0
    assert json.loads(path.read_text()) == {"flops": 16}
