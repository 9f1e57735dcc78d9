"""Feed-forward blocks: the gated MLP (SwiGLU, GeGLU) and the activations families name in their configs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from day0jax.core.errors import UnsupportedArchitecture
from day0jax.layers.linear import Linear, project_together
from kernels_pallas.calls import OpCall

# HF `hidden_act` / `hidden_activation` names -> functions, with HF's exact formulas.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # CLIP's vision towers
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
}


def activation(name: str, key: str = "hidden_act"):
    """The activation function named `name`.

    Raises:
        UnsupportedArchitecture: unknown name, naming the config key.
    """
    if name not in ACTIVATIONS:
        raise UnsupportedArchitecture(f"{key}={name!r} is not implemented (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with gelu; with `gated=False`, down(act(up(x))) and no
    gate_proj (Arcee). `multipliers` (g, d): down(act(g * gate(x)) * up(x)) * d (Falcon-H1's muP `mlp_multipliers`).
    `limit` L: down(min(act(gate(x)), L) * clip(up(x), -L, L)) (Step-3.7's per-layer clamps, after the activation);
    `input_limit` L: down(act(min(gate(x), L)) * clip(up(x), -L, L)) (DeepSeek-V4's, before it). `names`: HF's
    names of the up and down projections where they are others (StarCoder2's `c_fc`, `c_proj`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, *, use_bias: bool = False,
                 gated: bool = True, multipliers: tuple[float, float] = (1.0, 1.0), limit: float | None = None,
                 input_limit: float | None = None, names: tuple[str, str] = ("up_proj", "down_proj"),
                 dtype=jnp.float32, rngs: nnx.Rngs):
        D, F = hidden_size, intermediate_size
        self.gate_proj = (Linear((D,), (F,), ("embed", "mlp"), use_bias=use_bias, dtype=dtype, rngs=rngs)
                          if gated else None)
        self.names = tuple(names)
        setattr(self, names[0], Linear((D,), (F,), ("embed", "mlp"), use_bias=use_bias, dtype=dtype, rngs=rngs))
        setattr(self, names[1], Linear((F,), (D,), ("mlp", "embed"), use_bias=use_bias, dtype=dtype, rngs=rngs))
        self.act, self.act_name = activation(act), act
        self.multipliers, self.limit, self.input_limit = tuple(multipliers), limit, input_limit

    @property
    def up(self) -> Linear:
        return getattr(self, self.names[0])

    @property
    def down(self) -> Linear:
        return getattr(self, self.names[1])

    @jax.named_scope("mlp")
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.gate_proj is None:
            return self.down(self.act(self.up(x)))
        gate, up = project_together(x, (self.gate_proj, self.up))
        g, d = self.multipliers
        if self.input_limit is not None:
            gate, up = jnp.minimum(gate, self.input_limit), jnp.clip(up, -self.input_limit, self.input_limit)
        gate = self.act(gate if g == 1.0 else gate * g)
        if self.limit is not None:
            gate, up = jnp.minimum(gate, self.limit), jnp.clip(up, -self.limit, self.limit)
        out = self.down(gate * up)
        return out if d == 1.0 else out * d

    def op_calls(self) -> list[OpCall]:
        ungated = {} if self.gate_proj is not None else dict(gated=False)
        return [OpCall.of("mlp", D=self.down.out_shape[0], F=self.up.out_shape[0], act=self.act_name,
                          **ungated)]
