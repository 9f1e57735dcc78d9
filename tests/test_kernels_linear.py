"""The linear op (float weights): its shared contract test, run by every implementation that can run here, the CPU
kernel's own checks, and the routing: which inputs the C++ kernel takes (decode-sized rows; one row of a float32
weight only up to 2 MiB; bfloat16 of any size), which keep XLA's product (more rows, kernels="reference", a mesh of
several devices), and one call for a layer's q, k and v.

Implementations are compared with the float64 product of the same values, each output within the bound of a float32
sum of I exact products in any order: I * 2^-24 of the sum of the products' magnitudes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import registry
from kernels_pallas.linear import api, cpu_ffi


def float32_bound_ratio(got, x, kernel, in_ndim: int) -> float:
    """max |got - x W^T| over its float32 summation bound, W flattened to [O, I] (at most 1 when float32-tight)."""
    x64 = np.asarray(x, np.float64).reshape(-1, int(np.prod(x.shape[x.ndim - in_ndim:])))
    w64 = np.asarray(kernel, np.float64).reshape(-1, x64.shape[1])
    want, scale = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    error = np.abs(np.asarray(got, np.float64).reshape(want.shape) - want)
    return float((error / (x64.shape[1] * 2.0 ** -24 * scale + 1e-30)).max())


def uses(fn, *args) -> tuple[int, int]:
    """(calls of the one-weight kernel, calls of the several-weights kernel) in fn's lowered program."""
    text = jax.jit(fn).lower(*args).as_text()
    return text.count(f"@{cpu_ffi.TARGET}("), text.count(f"@{cpu_ffi.MANY_TARGET}(")


class LinearContract:
    implementation: str

    @pytest.mark.parametrize("rows", [1, 3, 8, 16])
    @pytest.mark.parametrize("in_shape, out_shapes", [((96,), [(37,)]), ((2, 48), [(4, 16), (2, 16), (2, 16)])])
    def test_matches_the_float64_product(self, rows, in_shape, out_shapes):
        """One weight of 37 outputs (not a multiple of the kernel's chunk or vector width), and q/k/v-like weights
        with heads as their own axes in one call, float32 throughout."""
        rng = np.random.default_rng(rows)
        x = jnp.asarray(rng.standard_normal((rows, *in_shape)), jnp.float32)
        kernels = [jnp.asarray(rng.standard_normal((*out, *in_shape)), jnp.float32) for out in out_shapes]
        got = jax.jit(lambda x, ks: api.linear(x, ks, len(in_shape), implementation=self.implementation))(x, kernels)
        for y, kernel, out in zip(got, kernels, out_shapes):
            assert y.shape == (rows, *out) and y.dtype == jnp.float32
            ratio = float32_bound_ratio(y, x, kernel, len(in_shape))
            assert ratio <= 1.0, f"{self.implementation} [{out} x {in_shape}] x {rows} rows: {ratio:.2f} x the bound"


class TestReference(LinearContract):
    implementation = "reference"


class TestCpuFfi(LinearContract):
    implementation = "cpu_ffi"


@pytest.mark.parametrize("I", [256, 96])  # steps of 64 inputs, and of 16
@pytest.mark.parametrize("dtype, rows", [("float32", 1), ("float32", 3), ("float32", 8), ("float32", 16),
                                         ("bfloat16", 1), ("bfloat16", 3), ("bfloat16", 8)])
def test_cpu_kernel_multiplies_float_weights_as_they_are(dtype, rows, I):
    """The dense and bf16 kinds: a float32 or bfloat16 kernel [O, I] streamed by the same code, float32-tight
    against the float64 product of the same values (bfloat16 weights and activations widen exactly); 37 outputs, not
    a multiple of the chunk or the vector width."""
    rng = np.random.default_rng(rows + I)
    w = jnp.asarray(rng.standard_normal((37, I)), dtype)
    x = jnp.asarray(rng.standard_normal((rows, I)), dtype)
    got = jax.jit(cpu_ffi.dense_matmul)(x, w)
    assert got.dtype == jnp.float32 and got.shape == (rows, 37)
    assert float32_bound_ratio(got, x, w, 1) <= 1.0


def test_dense_kernel_declines_what_it_does_not_take():
    w = jnp.ones((8, 64), jnp.float32)
    with pytest.raises(NotImplementedError, match="float32 and bfloat16"):
        cpu_ffi.dense_matmul(jnp.ones((1, 64), jnp.float32), jnp.ones((8, 64), jnp.float16))
    for kernel in (w, w.astype(jnp.bfloat16)):
        with pytest.raises(NotImplementedError, match="rows"):
            cpu_ffi.dense_matmul(jnp.ones((cpu_ffi.DENSE_MAX_ROWS[kernel.dtype] + 1, 64), kernel.dtype), kernel)
    with pytest.raises(NotImplementedError, match="multiple of 16"):
        cpu_ffi.dense_matmul(jnp.ones((1, 40), jnp.float32), jnp.ones((8, 40), jnp.float32))
    with pytest.raises(NotImplementedError, match="one row of a 2.5 MiB float32 weight"):
        cpu_ffi.dense_matmul(jnp.ones((1, 640), jnp.float32), jnp.ones((1024, 640), jnp.float32))
    x = jnp.ones((1, 64), jnp.float32)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("tp",))):
        with pytest.raises(NotImplementedError, match="mesh of 2 devices"):
            cpu_ffi.dense_matmul(x, w)
        assert registry.chosen("linear", x, [w]) == registry.REFERENCE  # the op keeps XLA's product there
    with pytest.raises(registry.KernelUnavailable, match="cpu_ffi"):
        api.linear(jnp.ones((cpu_ffi.DENSE_MAX_ROWS[w.dtype] + 1, 64)), [w], implementation="cpu_ffi")


def test_a_few_float32_rows_take_the_cpu_kernel():
    """Decode-sized float32 rows go to the kernel (small weights at one row, any at several), as XLA's product would
    compute them within float32 rounding; kernels="reference" and prefill-sized inputs keep XLA's product."""
    rng = np.random.default_rng(0)
    q_kernel = jnp.asarray(rng.standard_normal((4, 16, 64)), jnp.float32)  # [heads, head_dim, embed]: 16 KiB
    big = jnp.asarray(rng.standard_normal((1024, 640)), jnp.float32)  # 2.5 MiB
    took = {}
    for name, kernel, x in (("1 row", q_kernel, rng.standard_normal((1, 1, 64))),
                            ("8 rows, big", big, rng.standard_normal((2, 4, 640))),
                            ("1 row, big", big, rng.standard_normal((1, 1, 640))),
                            ("prefill", q_kernel, rng.standard_normal((1, 100, 64)))):
        x = jnp.asarray(x, jnp.float32)
        fn = lambda x, k: api.linear(x, [k])[0]  # noqa: E731
        took[name] = uses(fn, x, kernel)[0] == 1
        flat = np.asarray(kernel, np.float64).reshape(-1, x.shape[-1])
        want = np.einsum("...i,oi->...o", np.asarray(x, np.float64), flat)
        np.testing.assert_allclose(np.asarray(jax.jit(fn)(x, kernel)).reshape(want.shape), want, rtol=1e-4,
                                   atol=1e-4)
    if jax.default_backend() == "cpu":
        assert took == {"1 row": True, "8 rows, big": True, "1 row, big": False, "prefill": False}
    with registry.use_policy(registry.Policy(mode="reference")):
        assert uses(lambda x, k: api.linear(x, [k]), jnp.ones((1, 1, 64), jnp.float32), q_kernel) == (0, 0)


def test_a_few_bfloat16_rows_take_the_cpu_kernel():
    """bfloat16 weights: up to 8 rows go to the kernel whatever their size (XLA:CPU multiplies a bfloat16 matrix by a
    vector element by element, 10x slower), more keep XLA's product; the result is bfloat16, the float32 product of
    the same values rounded once."""
    rng = np.random.default_rng(1)
    big = jnp.asarray(rng.standard_normal((2, 1024, 640)), jnp.bfloat16)  # 2.5 MiB, heads as their own axis
    took = {}
    for rows in (1, 8, 16):
        x = jnp.asarray(rng.standard_normal((rows, 640)), jnp.bfloat16)
        fn = lambda x, k: api.linear(x, [k])[0]  # noqa: E731
        took[rows] = uses(fn, x, big)[0] == 1
        got = jax.jit(fn)(x, big)
        assert got.dtype == jnp.bfloat16 and got.shape == (rows, 2, 1024)
        want = np.einsum("ri,hoi->rho", np.asarray(x, np.float64), np.asarray(big, np.float64))
        scale = np.einsum("ri,hoi->rho", np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(big, np.float64)))
        summed = 640 * 2.0 ** -24 * scale  # float32 sums of 640 exact products, then one bfloat16 rounding
        assert (np.abs(np.asarray(got, np.float64) - want) <= 2.0 ** -8 * (np.abs(want) + summed) + summed).all()
    if jax.default_backend() == "cpu":
        assert took == {1: True, 8: True, 16: False}


def test_one_call_for_several_weights_equals_a_call_each():
    """`dense_matmul_many`: float32 and bfloat16 weights of different widths (one a single chunk, one not a multiple
    of the chunk) in one call give exactly what a call each gives; mismatched inputs are declined."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    kernels = [jnp.asarray(rng.standard_normal((o, 128)), dtype)
               for o, dtype in ((37, jnp.float32), (64, jnp.bfloat16), (5, jnp.float32), (100, jnp.float32))]
    got = jax.jit(cpu_ffi.dense_matmul_many)(x, kernels)
    assert len(got) == len(kernels)
    for k, y in zip(kernels, got):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(cpu_ffi.dense_matmul)(x, k)))
    with pytest.raises(NotImplementedError, match="does not take"):
        cpu_ffi.dense_matmul_many(x, [kernels[0], jnp.ones((8, 64), jnp.float32)])
    with pytest.raises(NotImplementedError, match="rows"):
        cpu_ffi.dense_matmul_many(jnp.ones((9, 128), jnp.float32), kernels)  # 9 rows: too many for bfloat16


def test_weights_the_kernel_declines_together_go_one_by_one():
    """At one row a weight over the size limit keeps XLA's product while the small ones of the same call still take
    the kernel, each on its own; the results are those of a call each."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((1, 640)), jnp.float32)
    kernels = [jnp.asarray(rng.standard_normal((o, 640)), jnp.float32) for o in (1024, 64, 64)]  # 2.5 MiB, small
    fn = lambda x, ks: api.linear(x, ks)  # noqa: E731
    if jax.default_backend() == "cpu":
        assert uses(fn, x, kernels) == (2, 0)
    for y, k in zip(jax.jit(fn)(x, kernels), kernels):
        np.testing.assert_allclose(np.asarray(y), np.asarray(api.linear(x, [k])[0]), rtol=1e-6, atol=1e-6)


def test_projections_of_the_same_input_share_one_call():
    """`layers.linear.project_together`: q/k/v-like `Linear`s (one with a bias, heads as their own axes) go to the
    CPU kernel in one call with the same results as each alone; kernels="reference" and prefill-sized inputs keep a
    product each."""
    from flax import nnx

    from day0jax.layers.linear import Linear, project_together

    rngs = nnx.Rngs(0)
    with nnx.use_eager_sharding(False):  # logical axis names, no mesh
        linears = (Linear((64,), (4, 16), ("embed", "heads", "head_dim"), rngs=rngs),
                   Linear((64,), (2, 16), ("embed", "kv_heads", "head_dim"), use_bias=True, rngs=rngs),
                   Linear((64,), (2, 16), ("embed", "kv_heads", "head_dim"), rngs=rngs))
    linears[1].bias[...] = jnp.arange(32, dtype=jnp.float32).reshape(2, 16)

    def calls(x):
        fn = lambda x: project_together(x, linears)  # noqa: E731
        for linear, y in zip(linears, jax.jit(fn)(x)):
            np.testing.assert_allclose(np.asarray(y), np.asarray(linear(x)), rtol=1e-5, atol=1e-5)
        return uses(fn, x)

    decode = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, 64)), jnp.float32)
    prefill = jnp.asarray(np.random.default_rng(1).standard_normal((1, 40, 64)), jnp.float32)
    if jax.default_backend() == "cpu":
        assert calls(decode) == (0, 1)  # the several-weights kernel, once
        assert calls(prefill) == (0, 0)
    with registry.use_policy(registry.Policy(mode="reference")):
        assert calls(decode) == (0, 0)
