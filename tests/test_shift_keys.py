"""GLAConfig.shift_keys: keys projected from the previous token's input, and what refuses it.

The layer is checked against a token-by-token loop written here from the equations (the state
update with the key of token t - 1), the model through backend="laplace" against eager, and the
paths that carry states alone (continuing from states, prefill, decode, generate) refuse it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import laplace_passes
import model_zoo
from laplace_passes.demo.train import DemoConfig
from model_zoo.gla_lm import GatedLinearAttention

CONFIG = model_zoo.config("tiny", shift_keys=True)


def _layer_by_token_loop(layer: GatedLinearAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer's output from the recurrence, one token at a time: token t writes k(x[t-1]) v(x[t])."""
    B, T, _ = x.shape
    H, K, V = layer.num_heads, layer.head_k_dim, layer.head_v_dim
    state = torch.zeros(B, H, K, V, dtype=torch.float64)
    outputs = []
    for t in range(T):
        previous = x[:, t - 1] if t > 0 else torch.zeros_like(x[:, 0])
        q = layer.q_proj(x[:, t]).unflatten(-1, (H, K)).double() * K**-0.5
        k = layer.k_proj(previous).unflatten(-1, (H, K)).double()
        v = layer.v_proj(x[:, t]).unflatten(-1, (H, V)).double()
        decay = (F.logsigmoid(layer.gk_proj(x[:, t])) / layer.gate_logit_normalizer).unflatten(-1, (H, K)).double()
        state = state * decay.exp()[..., None] + k[..., None] * v[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q, state))
    o = torch.stack(outputs, 1).float()
    o = layer.g_norm_swish_gate(o, layer.g_proj(x).unflatten(-1, (H, V)))
    return layer.o_proj(o.flatten(-2))


def _layer(seed: int = 0) -> GatedLinearAttention:
    torch.manual_seed(seed)
    layer = GatedLinearAttention(CONFIG)
    for p in layer.parameters():  # larger than the model's init, so that every term shows in the output
        torch.nn.init.normal_(p, std=0.3)
    return layer


def test_a_layer_with_shifted_keys_equals_the_token_loop_with_the_previous_tokens_key():
    layer = _layer()
    x = torch.randn(2, 9, CONFIG.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, _ = layer(x)
        expected = _layer_by_token_loop(layer, x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    # The option changes the output: the same weights with keys from the token itself differ.
    plain = GatedLinearAttention(CONFIG.replace(shift_keys=False))
    plain.load_state_dict(layer.state_dict())
    with torch.no_grad():
        assert not torch.allclose(plain(x)[0], out, atol=1e-3)


def test_the_key_of_token_t_reads_token_t_minus_1_only():
    layer = _layer(seed=2)
    x = torch.randn(1, 6, CONFIG.hidden_size, generator=torch.Generator().manual_seed(3))
    changed = x.clone()
    changed[:, 3] += 1.0
    with torch.no_grad():
        before, after = layer(x)[0], layer(changed)[0]
    assert torch.equal(before[:, :3], after[:, :3])  # causal: nothing before token 3 moves
    assert not torch.allclose(before[:, 4], after[:, 4])


def test_the_model_through_the_laplace_backend_equals_eager_values_and_gradients():
    torch.manual_seed(0)
    model = model_zoo.build("tiny", shift_keys=True)
    ids = torch.randint(1, 128, (2, 24), generator=torch.Generator().manual_seed(4))
    eager_logits = model(ids)
    eager_logits.square().mean().backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = laplace_passes.compile(model, target="cpu", inner="eager")
    logits = compiled(ids)
    logits.square().mean().backward()
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert [site["status"] for site in compiled.laplace_report.to_dict()["sites"]][:2] == ["retiled"] * 2


def test_paths_that_carry_only_the_states_refuse_a_model_with_shifted_keys():
    model = model_zoo.build("tiny", shift_keys=True)
    ids = torch.randint(1, 128, (1, 4))
    _, states = model(ids, output_final_states=True)
    with pytest.raises(ValueError, match=r"^initial_states: a model with shift_keys cannot continue a sequence"):
        model(ids, initial_states=states)
    with pytest.raises(ValueError, match=r"^token_mask: not available for a model with shift_keys"):
        model(ids, token_mask=torch.ones_like(ids, dtype=torch.bool))
    for what, call in (("generate", lambda: model.generate(ids, 2)), ("decode_step", lambda: model.decode_step),
                       ("compiled_prefill", lambda: model.compiled_prefill)):
        with pytest.raises(ValueError, match=rf"^{what}: not available for a model with shift_keys"):
            call()
    with pytest.raises(ValueError, match="shift_keys must be True or False, got 1"):
        model_zoo.config("tiny", shift_keys=1)


def test_the_demo_shifts_the_keys_of_model_zoos_models_only():
    assert DemoConfig().shift_keys is True and DemoConfig(model="plain-tiny").shift_keys is True
    assert DemoConfig(shift_keys=False).shift_keys is False
    assert DemoConfig(model="fla-gla-tiny").shift_keys is False
    with pytest.raises(ValueError, match="shift_keys is an option of model_zoo's models .* not of fla-gla-tiny"):
        DemoConfig(model="fla-gla-tiny", shift_keys=True)


def test_plain_tiny_with_shifted_keys_equals_tiny_with_them():
    """plain-tiny's layer (a scan in plain PyTorch) shifts its keys as tiny's does: same weights, same logits."""
    torch.manual_seed(0)
    tiny = model_zoo.build("tiny", shift_keys=True)
    plain = model_zoo.build("plain-tiny", shift_keys=True)
    plain.load_state_dict(tiny.state_dict())
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids), tiny(ids), rtol=1e-5, atol=1e-5)
        unshifted = model_zoo.build("plain-tiny")
        unshifted.load_state_dict(tiny.state_dict())
        assert not torch.allclose(unshifted(ids), tiny(ids), atol=1e-4)
