"""A GLA language model with flash-linear-attention's layer structure, in plain PyTorch.

The model exists to exercise `laplace_passes` end to end: every attention layer
calls the project's `gla` op, so `torch.compile(backend="laplace")` finds one GLA
site per layer, and everything else is ordinary ATen. Parameter names follow
fla's `GLAForCausalLM` (without its `model.` prefix), so fla checkpoints map onto
this model by renaming keys only.

Shapes: d = hidden_size, H heads, K = key_dim / H, V = value_dim / H; the
recurrent state of one layer is ``[B, H, K, V]`` in fp32 (docs/DESIGN.md section 3).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from laplace_passes.ops.gla import gla
from model_zoo.inputs import check_hidden_states, check_token_ids, check_token_mask

FP32_BYTES = 4
# Compiled callables kept on a model that hold the model itself: a copy must not call the original.
_COMPILED_HELPERS = ("_decode_step", "_ahead_of_time_step", "_compiled_prefill")


@dataclass(frozen=True)
class GLAConfig:
    """Hyper-parameters of a GLA LM; invalid values raise ValueError naming the field.

    `intermediate_size=None` means fla's rule (see `mlp_size`), kept unresolved so
    that `dataclasses.replace(config, hidden_size=...)` recomputes it.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    expand_k: float = 0.5
    expand_v: float = 1.0
    gate_low_rank_dim: int = 16
    gate_logit_normalizer: float = 16.0
    intermediate_size: int | None = None
    hidden_ratio: int = 4
    norm_eps: float = 1e-6
    initializer_range: float = 0.02
    # Keys from the previous token's input (see `shift_one_token`): off in every named config.
    shift_keys: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "gate_low_rank_dim", "hidden_ratio"):
            _require_positive_int(name, getattr(self, name))
        if self.intermediate_size is not None:
            _require_positive_int("intermediate_size", self.intermediate_size)
        if not isinstance(self.shift_keys, bool):
            raise ValueError(f"shift_keys must be True or False, got {self.shift_keys!r}")
        # A non-positive normalizer would turn logsigmoid's gates positive (growing decay).
        for name in ("expand_k", "expand_v", "gate_logit_normalizer", "norm_eps", "initializer_range"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for dim_name, expand_name in (("key_dim", "expand_k"), ("value_dim", "expand_v")):
            exact = self.hidden_size * getattr(self, expand_name)
            if exact != int(exact) or int(exact) < 1:
                raise ValueError(
                    f"{dim_name} = hidden_size * {expand_name} = {self.hidden_size} * "
                    f"{getattr(self, expand_name)} = {exact} must be a positive whole number"
                )
            if int(exact) % self.num_heads:
                raise ValueError(
                    f"{dim_name} = {int(exact)} (hidden_size * {expand_name}) must be divisible by "
                    f"num_heads = {self.num_heads}"
                )

    @property
    def key_dim(self) -> int:
        return int(self.hidden_size * self.expand_k)

    @property
    def value_dim(self) -> int:
        return int(self.hidden_size * self.expand_v)

    @property
    def head_k_dim(self) -> int:
        return self.key_dim // self.num_heads

    @property
    def head_v_dim(self) -> int:
        return self.value_dim // self.num_heads

    @property
    def mlp_size(self) -> int:
        """`intermediate_size`, or fla's GLAMLP rule: 2/3 of hidden_ratio * d, rounded up to 256."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        size = int(self.hidden_size * self.hidden_ratio * 2 / 3)
        return 256 * math.ceil(size / 256)

    def replace(self, **changes) -> GLAConfig:
        """`dataclasses.replace` with an error that names unknown fields and lists the valid ones."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise TypeError(f"unknown GLAConfig field(s) {unknown}; valid fields: {sorted(fields)}")
        return dataclasses.replace(self, **changes)


def _require_positive_int(name: str, value) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class GatedRMSNorm(nn.RMSNorm):
    """RMSNorm of each head's output, then an output gate silu(g).

    fla's FusedRMSNormGated(activation="swish"): the norm keeps the recurrence's
    output scale independent of how much state has accumulated, and the gate
    lets each token switch channels off.
    """

    def forward(self, x: Tensor, g: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(x) * F.silu(g)


class GatedLinearAttention(nn.Module):
    """fla's GatedLinearAttention layer (no short conv, no feature map, no GQA).

    The decay gates come from a low-rank projection squashed by
    ``logsigmoid(.) / gate_logit_normalizer``: always <= 0 (the op requires
    it), and the normalizer keeps decays close to 1 at initialisation so that
    memory is long from the start.

    With ``config.shift_keys`` the keys are projected from the previous
    token's input (`shift_one_token`), so each token writes "previous token ->
    this token" into the state: the one-token mixing that short convolutions
    give fla's models, and what associative recall needs (a value is stored
    under the key listed just before it). Without it the model must learn that
    shift from its decay gates, which `tiny` does not within the demo's budget.
    """

    def __init__(self, config: GLAConfig):
        super().__init__()
        d, key_dim, value_dim = config.hidden_size, config.key_dim, config.value_dim
        self.num_heads = config.num_heads
        self.head_k_dim = config.head_k_dim
        self.head_v_dim = config.head_v_dim
        self.gate_logit_normalizer = config.gate_logit_normalizer
        self.shift_keys = config.shift_keys

        self.q_proj = nn.Linear(d, key_dim, bias=False)
        self.k_proj = nn.Linear(d, key_dim, bias=False)
        self.v_proj = nn.Linear(d, value_dim, bias=False)
        self.g_proj = nn.Linear(d, value_dim, bias=False)
        self.gk_proj = nn.Sequential(
            nn.Linear(d, config.gate_low_rank_dim, bias=False),
            nn.Linear(config.gate_low_rank_dim, key_dim, bias=True),
        )
        self.g_norm_swish_gate = GatedRMSNorm(config.head_v_dim, eps=config.norm_eps)
        self.o_proj = nn.Linear(value_dim, d, bias=False)

    def forward(
        self, x: Tensor, initial_state: Tensor | None = None, output_final_state: bool = False,
        token_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        check_hidden_states(x, self.q_proj.in_features)
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        q = self.q_proj(x).unflatten(-1, (H, K))
        k = self.k_proj(shift_one_token(x) if self.shift_keys else x).unflatten(-1, (H, K))
        v = self.v_proj(x).unflatten(-1, (H, V))
        k, gate_logits = masked_keys_and_gates(k, self.gk_proj(x).unflatten(-1, (H, K)), token_mask)
        gk = F.logsigmoid(gate_logits) / self.gate_logit_normalizer
        o, state = self.recurrence(q, k, v, gk, initial_state, output_final_state)
        o = self.g_norm_swish_gate(o, self.g_proj(x).unflatten(-1, (H, V)))
        return self.o_proj(o.flatten(-2)), state

    def recurrence(self, q: Tensor, k: Tensor, v: Tensor, gk: Tensor, initial_state: Tensor | None,
                   output_final_state: bool) -> tuple[Tensor, Tensor | None]:
        """The GLA recurrence over the projected inputs: the project's `gla` op (a subclass may write its own)."""
        return gla(q, k, v, gk, initial_state=initial_state, output_final_state=output_final_state)


def shift_one_token(x: Tensor) -> Tensor:
    """``x`` ([B, T, d]) one token later: position t holds x[t - 1], position 0 zeros."""
    return F.pad(x, (0, 0, 1, 0))[:, :-1]


def masked_keys_and_gates(k: Tensor, gate_logits: Tensor, token_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """k and the gate logits ([B, T, H, K]) with every masked token made the identity update of the state.

    k = 0 adds nothing, and logsigmoid(+inf) = 0 is decay 1. Masking before logsigmoid keeps the gates
    provably <= 0 (NOTE [gates proven <= 0]), so a masked graph keeps no run-time gate check.
    """
    if token_mask is None:
        return k, gate_logits
    masked = ~token_mask[:, :, None, None]
    return k.masked_fill(masked, 0.0), gate_logits.masked_fill(masked, math.inf)


class SwiGLU(nn.Module):
    """fla's GatedMLP with swish: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GLABlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GLAConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = GatedLinearAttention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.mlp_size)

    def forward(
        self, x: Tensor, initial_state: Tensor | None = None, output_final_state: bool = False,
        token_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        h, state = self.attn(self.attn_norm(x), initial_state, output_final_state, token_mask)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), state


class GLALM(nn.Module):
    """Causal GLA language model with the output head tied to the embedding.

    Modules are created on the meta device and materialised once on `device`
    (default: torch's current default device), so building costs one normal_
    per weight and building on "meta" allocates nothing.
    """

    def __init__(
        self, config: GLAConfig, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.config = config
        device = torch.device(device) if device is not None else torch.get_default_device()
        with torch.device("meta"):
            self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(GLABlock(config) for _ in range(config.num_layers))
            self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if dtype is not None:
            self.to(dtype)
        self.tie_weights()
        if device.type != "meta":
            self.to_empty(device=device)
            self.tie_weights()  # to_empty may give each module its own copy
            self.reset_parameters()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.embeddings.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """fla's init: normal(0, initializer_range) for linear and embedding weights, zero biases, unit norms."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()

    def forward(
        self,
        input_ids: Tensor,
        *,
        initial_states: list[Tensor] | None = None,
        output_final_states: bool = False,
        token_mask: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Logits ``[B, T, vocab]``; with `output_final_states`, also one fp32 state per layer.

        Passing those states back as `initial_states` continues the sequence, so
        prefill in pieces and token-by-token decode equal one full forward.
        `token_mask` (bool ``[B, T]``, False for padding) leaves the states as they
        were at every masked token, so a prompt padded at its end to a fixed length
        returns its own final states (`model_zoo.prefill`); the logits at masked
        positions mean nothing.
        """
        check_token_ids(input_ids)
        check_token_mask(token_mask, input_ids)
        if initial_states is not None and self.config.shift_keys:
            raise ValueError(
                "initial_states: a model with shift_keys cannot continue a sequence from its states (the first "
                "token's key needs the previous token's input, which the states do not hold); run the whole sequence"
            )
        if token_mask is not None and self.config.shift_keys:
            raise ValueError(
                "token_mask: not available for a model with shift_keys (a token after padding would take its key "
                "from the padding's input); run the sequences unpadded"
            )
        if initial_states is not None and len(initial_states) != len(self.layers):
            raise ValueError(
                f"initial_states has {len(initial_states)} entries; the model has {len(self.layers)} layers"
            )
        x = self.embeddings(input_ids)
        states = []
        for i, layer in enumerate(self.layers):
            x, state = layer(x, None if initial_states is None else initial_states[i], output_final_states, token_mask)
            states.append(state)
        logits = self.lm_head(self.norm(x))
        return (logits, states) if output_final_states else logits

    def generate(self, input_ids: Tensor, max_new_tokens: int, **kwargs):
        """Prefill then recurrent decode; see `model_zoo.generate.generate`."""
        from model_zoo.generate import generate

        self._require_no_shift_keys("generate")
        return generate(self, input_ids, max_new_tokens, **kwargs)

    def _require_no_shift_keys(self, what: str) -> None:
        """Prefill and decode carry the states only; a shifted key also needs the previous token's input."""
        if self.config.shift_keys:
            raise ValueError(
                f"{what}: not available for a model with shift_keys (prefill and decode carry the recurrent states "
                "only, not the previous token's input its keys need); build the model without shift_keys to generate"
            )

    @property
    def decode_step(self):
        """This model's compiled decode step (`model_zoo.decode.DecodeStep`), made at first use and kept."""
        return self._kept_helper("decode_step", "model_zoo.decode", "DecodeStep")

    @property
    def ahead_of_time_step(self):
        """This model's decode step compiled ahead of time (`model_zoo.decode_ahead.AheadOfTimeStep`), made at
        first use and kept."""
        return self._kept_helper("ahead_of_time_step", "model_zoo.decode_ahead", "AheadOfTimeStep")

    @property
    def compiled_prefill(self):
        """This model's compiled prefill (`model_zoo.prefill.CompiledPrefill`), made at first use and kept."""
        return self._kept_helper("compiled_prefill", "model_zoo.prefill", "CompiledPrefill")

    def _kept_helper(self, what: str, module: str, name: str):
        """The compiled helper `module.name`, this model's `what`, built at first use and kept (in `_COMPILED_HELPERS`
        as "_" + what); the module is imported only then, as it imports laplace_passes' compile stack."""
        helper = self.__dict__.get("_" + what)
        if helper is None:
            self._require_no_shift_keys(what)
            helper = getattr(importlib.import_module(module), name)(self)
            self.__dict__["_" + what] = helper
        return helper

    def __getstate__(self):
        """Copies and pickles leave the compiled step and prefill behind (they hold this model); they make their own."""
        state = super().__getstate__()
        return {k: v for k, v in state.items() if k not in _COMPILED_HELPERS}

    def num_parameters(self) -> int:
        """Counts the tied embedding / head weight once."""
        return sum(p.numel() for p in self.parameters())

    def recurrent_state_bytes_per_sequence(self) -> int:
        """fp32 state of every layer; unlike a KV cache it does not grow with context."""
        c = self.config
        return c.num_layers * c.num_heads * c.head_k_dim * c.head_v_dim * FP32_BYTES

    def kv_cache_bytes_softmax(self, context_len: int, bytes_per_elem: int = 2) -> int:
        """KV cache of a softmax-attention model of the same depth and width, for comparison."""
        c = self.config
        return 2 * c.num_layers * context_len * c.hidden_size * bytes_per_elem
