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
    `limit` L: down(min(act(gate(x)), L) * clip(up(x), -L, L)) (Step-3.7's per-layer clamps, after the activation)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, *, use_bias: bool = False,
                 gated: bool = True, multipliers: tuple[float, float] = (1.0, 1.0), limit: float | None = None,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        D, F = hidden_size, intermediate_size
        self.gate_proj = (Linear((D,), (F,), ("embed", "mlp"), use_bias=use_bias, dtype=dtype, rngs=rngs)
                          if gated else None)
        self.up_proj = Linear((D,), (F,), ("embed", "mlp"), use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear((F,), (D,), ("mlp", "embed"), use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.act, self.act_name = activation(act), act
        self.multipliers, self.limit = tuple(multipliers), limit

    @jax.named_scope("mlp")
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))
        gate, up = project_together(x, (self.gate_proj, self.up_proj))
        g, d = self.multipliers
        gate = self.act(gate if g == 1.0 else gate * g)
        if self.limit is not None:
            gate, up = jnp.minimum(gate, self.limit), jnp.clip(up, -self.limit, self.limit)
        out = self.down_proj(gate * up)
        return out if d == 1.0 else out * d

    def op_calls(self) -> list[OpCall]:
        ungated = {} if self.gate_proj is not None else dict(gated=False)
        return [OpCall.of("mlp", D=self.down_proj.out_shape[0], F=self.up_proj.out_shape[0], act=self.act_name,
                          **ungated)]
