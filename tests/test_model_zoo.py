"""The GLA LM in model_zoo: shapes, tying, gates, one layer against a hand-written
recurrence, chunked prefill, the 3B config on meta, config errors, gradients, and
every model's refusal of token ids of the wrong shape or dtype.

Sequences stay short: the eager `gla` op is a token loop.
"""

import pytest
import torch
import torch.nn.functional as F

import model_zoo
import model_zoo.gla_lm as gla_lm


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return model_zoo.build("tiny")


def _ids(model, B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (B, T), generator=g)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_logits_shape(name):
    model = model_zoo.build(name)
    logits = model(_ids(model, 2, 8))
    assert logits.shape == (2, 8, model.config.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_output_final_states_shapes(tiny):
    logits, states = tiny(_ids(tiny, 3, 5), output_final_states=True)
    c = tiny.config
    assert logits.shape == (3, 5, c.vocab_size)
    assert len(states) == c.num_layers
    for s in states:
        assert s.shape == (3, c.num_heads, c.head_k_dim, c.head_v_dim) == (3, 2, 16, 32)
        assert s.dtype == torch.float32


def test_lm_head_is_tied_to_embedding(tiny):
    assert tiny.lm_head.weight is tiny.embeddings.weight
    with torch.no_grad():
        tiny.embeddings.weight[3, 5] = 123.0
    assert tiny.lm_head.weight[3, 5].item() == 123.0
    unique = {id(p): p for m in tiny.modules() for p in m.parameters(recurse=False)}
    assert tiny.num_parameters() == sum(p.numel() for p in unique.values())
    assert len(list(tiny.parameters())) == len(unique)


def test_every_gate_is_non_positive(tiny, monkeypatch):
    seen, real_gla = [], gla_lm.gla

    def recording_gla(q, k, v, gk, **kwargs):
        seen.append(gk.detach().clone())
        return real_gla(q, k, v, gk, **kwargs)

    monkeypatch.setattr(gla_lm, "gla", recording_gla)
    # Saturate the gate logits both ways: logsigmoid must still give gk <= 0.
    with torch.no_grad():
        for block in tiny.layers:
            block.attn.gk_proj[1].weight.normal_(0, 50.0)
            block.attn.gk_proj[1].bias.uniform_(-100.0, 100.0)
    tiny(_ids(tiny, 2, 12))
    assert len(seen) == tiny.config.num_layers
    for gk in seen:
        assert gk.shape == (2, 12, 2, 16)
        assert (gk <= 0).all()
        assert (gk < -1).any() and (gk > -1e-3).any()  # both saturated ends were exercised


def _reference_attention(attn, x, initial_state):
    """fla's GLA layer written out: projections, gates, token loop, per-head RMSNorm, swish gate."""
    B, T, _ = x.shape
    H, K, V = attn.num_heads, attn.head_k_dim, attn.head_v_dim
    q = F.linear(x, attn.q_proj.weight).reshape(B, T, H, K)
    k = F.linear(x, attn.k_proj.weight).reshape(B, T, H, K)
    v = F.linear(x, attn.v_proj.weight).reshape(B, T, H, V)
    g = F.linear(x, attn.g_proj.weight).reshape(B, T, H, V)
    low, up = attn.gk_proj
    gate_logits = F.linear(F.linear(x, low.weight), up.weight, up.bias).reshape(B, T, H, K)
    gk = -torch.log1p(torch.exp(-gate_logits)) / 16.0  # logsigmoid, normalizer 16
    S = initial_state.clone()
    outs = []
    for t in range(T):
        S = S * gk[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S) * K**-0.5)
    o = torch.stack(outs, dim=1)
    norm = attn.g_norm_swish_gate
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    o = o * g * torch.sigmoid(g)
    return F.linear(o.reshape(B, T, H * V), attn.o_proj.weight), S


def test_one_attention_layer_matches_plain_recurrence(tiny):
    attn = tiny.layers[0].attn
    torch.manual_seed(2)
    with torch.no_grad():  # weights far from init, so every term matters
        for p in attn.parameters():
            p.normal_(0, 0.3)
    B, T = 2, 12
    x = torch.randn(B, T, tiny.config.hidden_size)
    h0 = torch.randn(B, attn.num_heads, attn.head_k_dim, attn.head_v_dim)
    out, state = attn(x, h0, output_final_state=True)
    ref_out, ref_state = _reference_attention(attn, x, h0)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cuts", [[10], [7, 8, 9]])  # prefill, then prefill + single-token decode steps
def test_prefill_in_pieces_equals_full_forward(tiny, cuts):
    ids = _ids(tiny, 2, 24)
    with torch.no_grad():
        full, full_states = tiny(ids, output_final_states=True)
        pieces, states, start = [], None, 0
        for end in [*cuts, ids.shape[1]]:
            logits, states = tiny(ids[:, start:end], initial_states=states, output_final_states=True)
            pieces.append(logits)
            start = end
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    for s, f in zip(states, full_states):
        torch.testing.assert_close(s, f, rtol=1e-5, atol=1e-5)


def test_initial_states_must_match_layer_count(tiny):
    _, states = tiny(_ids(tiny, 1, 3), output_final_states=True)
    with pytest.raises(ValueError, match="layers"):
        tiny(_ids(tiny, 1, 3), initial_states=states[:1])


def test_laplace_3b_on_meta():
    model = model_zoo.build("laplace-3b")
    c = model.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.head_k_dim, c.head_v_dim, c.vocab_size) == (
        2560, 36, 16, 80, 160, 32000)
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert model.lm_head.weight is model.embeddings.weight
    assert 2.7e9 < model.num_parameters() < 3.2e9
    assert model.recurrent_state_bytes_per_sequence() == 36 * 16 * 80 * 160 * 4 == 29_491_200
    assert model.kv_cache_bytes_softmax(4096) == 2 * 36 * 4096 * 2560 * 2
    assert model.kv_cache_bytes_softmax(4096, bytes_per_elem=4) == 2 * model.kv_cache_bytes_softmax(4096)


def test_build_device_and_overrides():
    model = model_zoo.build("tiny", device="meta", num_layers=3)
    assert all(p.is_meta for p in model.parameters()) and len(model.layers) == 3
    assert model_zoo.config("small").mlp_size == 768  # int(256 * 4 * 2/3) = 682 -> next multiple of 256
    assert model_zoo.config("small", intermediate_size=100).mlp_size == 100
    assert model_zoo.build("tiny", dtype=torch.bfloat16).embeddings.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"num_heads": 3}, "key_dim"),  # key_dim 32 is not divisible by 3
        ({"expand_v": 0.75, "num_heads": 4, "hidden_size": 40}, "value_dim"),
        ({"expand_k": 0.3}, "key_dim"),  # 64 * 0.3 is not whole
        ({"hidden_size": 0}, "hidden_size"),
        ({"vocab_size": -5}, "vocab_size"),
        ({"num_layers": 1.5}, "num_layers"),
        ({"gate_logit_normalizer": -16}, "gate_logit_normalizer"),
        ({"intermediate_size": 0}, "intermediate_size"),
        ({"norm_eps": 0.0}, "norm_eps"),
    ],
)
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        model_zoo.config("tiny", **overrides)


def test_unknown_override_is_named():
    with pytest.raises(TypeError, match="hiden_size"):
        model_zoo.build("tiny", hiden_size=32)


def test_unknown_config_name_lists_names():
    with pytest.raises(ValueError) as info:
        model_zoo.build("huge")
    for name in model_zoo.CONFIG_NAMES:
        assert name in str(info.value)
    assert {"tiny", "small", "laplace-3b", "fla-gla-tiny", "fla-gla-1.3b"} <= set(model_zoo.CONFIG_NAMES)


def test_gradients_reach_every_parameter(tiny):
    ids = _ids(tiny, 2, 16)
    logits = tiny(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    for name, p in tiny.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


IDS_EXPECTED = "input_ids must be [batch, seq_len] integer token ids"
BAD_TOKEN_IDS = [
    (lambda ids: ids[0], ValueError, f"{IDS_EXPECTED}, got shape [16]: for one sequence pass input_ids[None]"),
    (lambda ids: ids[..., None], ValueError, f"{IDS_EXPECTED}, got shape [2, 16, 1]: drop the trailing dimension"),
    (lambda ids: ids[None], ValueError, f"{IDS_EXPECTED}, got shape [1, 2, 16]"),
    (lambda ids: ids.float(), TypeError, f"{IDS_EXPECTED} (torch.long or torch.int32), got dtype torch.float32: "
                                         "cast them with input_ids.long()"),
    (lambda ids: ids.tolist(), TypeError, f"{IDS_EXPECTED} (a torch.Tensor), got list"),
]


@pytest.mark.parametrize("bad, error, message", BAD_TOKEN_IDS, ids=["T", "BT1", "1BT", "float", "list"])
@pytest.mark.parametrize("name", model_zoo.CONFIG_NAMES)
def test_token_ids_of_the_wrong_shape_or_dtype_are_named_with_the_expected_shape(name, bad, error, message):
    """Each model's forward names its input, before a tensor made inside (q, a norm's input) fails."""
    if name.startswith("fla-"):
        pytest.importorskip("fla", reason="fla models need flash-linear-attention")
    model = model_zoo.build(name, device="meta")  # refused before any weight is read
    ids = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(error) as info:
        model(bad(ids))
    assert str(info.value).startswith(message)
    if not name.startswith("fla-"):  # fla's layers run Triton kernels outside a laplace-compiled graph
        assert model(ids).shape == (2, 16, model.config.vocab_size)


def test_a_layer_names_its_hidden_states_shape(tiny):
    x = torch.randn(16, tiny.config.hidden_size)
    for layer in (tiny.layers[0].attn, model_zoo.build("plain-tiny").layers[0].attn):
        with pytest.raises(ValueError, match=r"^x must be \[batch, seq_len, hidden_size=64\] hidden states, "
                                             r"got shape \[16, 64\]$"):
            layer(x)
        assert layer(x[None])[0].shape == (1, 16, 64)
