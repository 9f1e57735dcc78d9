"""The causal conv1d op: its reference against the definition written in NumPy (with and without SiLU, padded
rows), a sequence run in chunks and decode steps, each call from the state the previous one left, against one call,
and the layers that call it (LFM's gated short convolution) against their own definition. transformers' functions
are compared in test_kernels_gated_delta_rule.py, whose reference run computes them. All in float32.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels_pallas.causal_conv1d import api, reference


def conv_inputs(seed, B, T, C, W):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, T, C)).astype(np.float32), rng.standard_normal((C, W)).astype(np.float32),
            rng.standard_normal((B, W - 1, C)).astype(np.float32))


def test_causal_conv1d_valid_keeps_padding_out_of_the_state():
    x, w, state = conv_inputs(50, 3, 6, 5, 4)
    valid = np.array([6, 2, 0], np.int32)
    out, new_state = reference.causal_conv1d(jnp.asarray(x), jnp.asarray(w), jnp.asarray(state),
                                             valid=jnp.asarray(valid))
    full_out, _ = reference.causal_conv1d(jnp.asarray(x), jnp.asarray(w), jnp.asarray(state))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(full_out))  # valid changes only the state
    for b, n in enumerate(valid):
        np.testing.assert_array_equal(np.asarray(new_state[b]), np.concatenate([state[b], x[b, :n]])[-3:])
    # A prompt in two pieces, the first one padded: the second piece sees only the real tokens before it.
    _, s1 = reference.causal_conv1d(jnp.asarray(x[:1, :4]), jnp.asarray(w), jnp.asarray(state[:1]),
                                    valid=jnp.asarray([2]))
    out2, _ = reference.causal_conv1d(jnp.asarray(x[:1, 2:]), jnp.asarray(w), s1)
    np.testing.assert_allclose(np.asarray(out2), np.asarray(full_out[:1, 2:]), rtol=1e-6, atol=1e-6)


def test_causal_conv1d_bias_without_activation():
    """LFM's form: a bias and no SiLU, against a NumPy loop over the definition; SiLU is the only difference."""
    B, T, C, W = 2, 7, 5, 3
    x, w, state = conv_inputs(51, B, T, C, W)
    bias = np.random.default_rng(52).standard_normal(C).astype(np.float32)
    full = np.concatenate([state, x], axis=1)
    want = np.stack([sum(full[:, t + j] * w[:, j] for j in range(W)) + bias for t in range(T)], axis=1)
    out, new_state = reference.causal_conv1d(jnp.asarray(x), jnp.asarray(w), jnp.asarray(state),
                                             bias=jnp.asarray(bias), activation=None)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(new_state), full[:, -(W - 1):])
    silu, _ = reference.causal_conv1d(jnp.asarray(x), jnp.asarray(w), jnp.asarray(state), bias=jnp.asarray(bias))
    np.testing.assert_allclose(np.asarray(silu), want / (1 + np.exp(-want)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("activation", ["silu", None])
def test_chunks_carrying_the_state_give_one_call(activation):
    """A prompt in chunks (one shorter than the width), then decode steps, each call through the op from the state
    the previous one left, from a sequence start (no state): the outputs and the final state of one call."""
    B, T, C, W = 2, 11, 6, 4
    x, w, _ = conv_inputs(53, B, T, C, W)
    bias = jnp.asarray(np.random.default_rng(54).standard_normal(C).astype(np.float32))
    whole, whole_state = api.causal_conv1d(jnp.asarray(x), jnp.asarray(w), bias=bias, activation=activation)
    pieces, state = [], None
    for start, end in ((0, 5), (5, 7), (7, 9), (9, 10), (10, 11)):
        out, state = api.causal_conv1d(jnp.asarray(x[:, start:end]), jnp.asarray(w), state, bias=bias,
                                       activation=activation)
        pieces.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), np.asarray(whole), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state), np.asarray(whole_state))


def test_the_api_refuses_what_the_contract_does_not_take():
    x, w, state = conv_inputs(55, 1, 3, 4, 3)
    with pytest.raises(ValueError, match="weight"):
        api.causal_conv1d(jnp.asarray(x), jnp.asarray(w.T))
    with pytest.raises(ValueError, match="state"):
        api.causal_conv1d(jnp.asarray(x), jnp.asarray(w), jnp.asarray(state[:, :1]))
    with pytest.raises(ValueError, match="activation"):
        api.causal_conv1d(jnp.asarray(x), jnp.asarray(w), activation="gelu")


@dataclass
class Slots:
    """The engine's per-sequence state as the layer sees it (`engine.state_cache.StateCache`), for whole rows."""

    states: tuple
    valid: jax.Array
    targets: None = None  # a verify step's per-token state slots: not one here

    def read(self):
        return self.states

    def write(self, states):
        return Slots(states, self.valid)


def test_the_short_convolution_layer_runs_the_op_across_chunks():
    """LFM's gated short convolution: in_proj to B, C, x; the convolution of B * x (bias, no activation); C times
    it; out_proj. Written in NumPy with the layer's weights, it equals one cache-less call and two chunks carrying
    the state through the cache."""
    from day0jax.layers.short_conv import ShortConv

    B, T, D, W = 2, 7, 16, 3
    with nnx.use_eager_sharding(False):
        layer = ShortConv(hidden_size=D, kernel_size=W, use_bias=True, rngs=nnx.Rngs(0))
    for p in (layer.in_proj.bias, layer.conv.bias, layer.out_proj.bias):  # non-zero, so each one counts
        p[...] = jnp.asarray(np.random.default_rng(56).standard_normal(p[...].shape), jnp.float32)
    x = np.random.default_rng(57).standard_normal((B, T, D)).astype(np.float32)
    proj = np.einsum("gdi,bti->btgd", np.asarray(layer.in_proj.kernel[...]), x) + np.asarray(layer.in_proj.bias[...])
    u = np.concatenate([np.zeros((B, W - 1, D), np.float32), proj[..., 0, :] * proj[..., 2, :]], axis=1)
    w = np.asarray(layer.conv.weight[...])
    conv = np.stack([sum(u[:, t + j] * w[:, j] for j in range(W)) for t in range(T)], axis=1)
    conv += np.asarray(layer.conv.bias[...])
    want = (proj[..., 1, :] * conv) @ np.asarray(layer.out_proj.kernel[...]).T + np.asarray(layer.out_proj.bias[...])
    whole, _ = layer(jnp.asarray(x), None, {})
    np.testing.assert_allclose(np.asarray(whole), want, rtol=1e-5, atol=1e-5)
    states, pieces = (jnp.zeros((B, W - 1, D), jnp.float32),), []
    for start, end in ((0, 4), (4, T)):
        out, cache = layer(jnp.asarray(x[:, start:end]), None, {}, Slots(states, jnp.full((B,), end - start)))
        states = cache.states
        pieces.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), want, rtol=1e-5, atol=1e-5)
