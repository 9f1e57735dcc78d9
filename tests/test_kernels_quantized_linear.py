"""The quantized linear op: its formats against their own definitions, and its shared contract test, run by every
implementation that can run here.

The reference is the definition: GGUF's block math as the `gguf` package dequantizes it (bitwise), float8_e4m3fn
as ml_dtypes converts it (bitwise). Implementations are compared with the float64 product of the dequantized
weight, each output within the bound of a float32 sum of I products in any order: I * 2^-24 of the sum of the
products' magnitudes.
"""

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from convert import gguf_blocks as gguf_blocks_lib
from kernels_pallas import cases, registry
from kernels_pallas.quantized_linear import api, cpu_ffi, reference, spec
from kernels_pallas.quantized_linear.reference import QuantizedWeight

# (kind, group, offsets, scale dtype): every format the converter writes.
FORMATS = {
    "int8-f16": ("int8", 32, False, "float16"),
    "int8-bf16-g64": ("int8", 64, False, "bfloat16"),
    "int4-offset-f16": ("int4", 32, True, "float16"),
    "int4-symmetric-bf16": ("int4", 32, False, "bfloat16"),
    "int4-offset-f32-g128": ("int4", 128, True, "float32"),
    "fp8-f32-g128": ("fp8", 128, False, "float32"),
    "int8-offset-f32-g16": ("int8", 16, True, "float32"),
    "mxfp4": ("mxfp4", 32, False, "uint8"),
    "nvfp4": ("nvfp4", 16, False, "float8_e4m3fn"),
    "mxfp8-e4m3": ("mxfp8_e4m3", 32, False, "uint8"),
    "mxfp8-e5m2": ("mxfp8_e5m2", 32, False, "uint8"),
}


def weight(name: str, O: int = 80, I: int = 256, seed: int = 0) -> tuple[np.ndarray, QuantizedWeight]:
    kind, group, offsets, scale_dtype = FORMATS[name]
    w = np.random.default_rng(seed).standard_normal((O, I)).astype(np.float32)
    q = reference.quantize(w, kind, group, offsets=offsets, scale_dtype=scale_dtype)
    if offsets and kind == "int8":  # no quantizer writes int8 with offsets; K-quant blocks re-blocked would
        q = QuantizedWeight(q.codes, q.scale, q.scale * 3, kind, group)
    return w, jax.tree.map(jnp.asarray, q)


def float64_product(x, q: QuantizedWeight) -> np.ndarray:
    return np.asarray(x, np.float64) @ np.asarray(reference.dequantize(q), np.float64).T


def assert_float32_tight(got, x, q: QuantizedWeight, what: str) -> None:
    w = np.asarray(reference.dequantize(q), np.float64)
    x = np.asarray(x, np.float64)
    bound = x.shape[1] * 2.0 ** -24 * (np.abs(x) @ np.abs(w).T) + 1e-30
    ratio = (np.abs(np.asarray(got, np.float64) - x @ w.T) / bound).max()
    assert ratio <= 1.0, f"{what}: error {ratio:.2f} x the float32 summation bound"


class QuantizedLinearContract:
    implementation: str
    declines: tuple[str, ...] = ()  # formats the implementation leaves to the next candidate

    @pytest.mark.parametrize("rows", [1, 3, 8, 16, 45])  # 45: passes of 8, 4 and 1 rows
    @pytest.mark.parametrize("name", sorted(FORMATS))
    def test_matches_the_dequantized_product(self, name, rows):
        _, q = weight(name)
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 256)), jnp.float32)
        if FORMATS[name][0] in self.declines:
            with pytest.raises(registry.KernelUnavailable, match=FORMATS[name][0]):
                api.quantized_matmul(x, q, implementation=self.implementation)
            return
        got = jax.jit(lambda x, q: api.quantized_matmul(x, q, implementation=self.implementation))(x, q)
        assert got.shape == (rows, 80) and got.dtype == jnp.float32
        assert_float32_tight(got, x, q, f"{self.implementation} {name} x {rows} rows")


class TestReference(QuantizedLinearContract):
    implementation = "reference"


class TestCpuFfi(QuantizedLinearContract):
    implementation = "cpu_ffi"


def test_cpu_kernel_declines_what_it_does_not_take():
    _, q = weight("int8-f16")
    with pytest.raises(registry.KernelUnavailable, match="rows"):
        api.quantized_matmul(jnp.ones((cpu_ffi.MAX_ROWS + 1, 256)), q, implementation="cpu_ffi")
    with pytest.raises(registry.KernelUnavailable, match="float activations"):
        api.quantized_matmul(jnp.ones((2, 256), jnp.int32), q, implementation="cpu_ffi")
    # Under a mesh of several devices the call would gather the codes; the reference's product stays split.
    x = jnp.ones((2, 256))
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("tp",))):
        with pytest.raises(NotImplementedError, match="mesh of 2 devices"):
            cpu_ffi.quantized_matmul(x, q)
    many = jnp.ones((cpu_ffi.MAX_ROWS + 1, 256))  # the pool still answers, through the reference
    np.testing.assert_allclose(api.quantized_matmul(many, q), reference.quantized_matmul(many, q), rtol=1e-5)


@pytest.mark.parametrize("name", ["int4-offset-f16", "fp8-f32-g128"])
def test_cpu_kernel_widens_16_bit_activations_exactly(name):
    _, q = weight(name)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 256)), jnp.bfloat16)
    got = api.quantized_matmul(x, q, implementation="cpu_ffi")
    assert got.dtype == jnp.float32
    assert_float32_tight(got, x.astype(jnp.float32), q, f"cpu_ffi {name}, bfloat16 activations")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_xla_dot_is_within_16_bit_rounding_of_the_reference(name, dtype):
    """The GPU and TPU candidate multiplies x by the dequantized weight rounded to x's dtype: within that dtype's
    rounding of each product (2^-8 for bfloat16, 2^-11 for float16) of the reference. (GPUs accumulate such products
    in float32; XLA:CPU, where this runs, rounds its 16-bit products' sums more coarsely, so no tighter bound holds
    on every backend.)"""
    _, q = weight(name)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 256)), dtype)
    got = jax.jit(lambda x, q: api.quantized_matmul(x, q, implementation="xla_dot"))(x, q)
    assert got.shape == (3, 80) and got.dtype == jnp.float32
    magnitude = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(reference.dequantize(q), np.float64)).T
    unit = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11
    assert (np.abs(np.asarray(got) - float64_product(x, q)) <= unit * magnitude).all()


def test_xla_dot_leaves_float32_activations_to_the_reference():
    _, q = weight("int8-f16")
    with pytest.raises(registry.KernelUnavailable, match="float32"):
        api.quantized_matmul(jnp.ones((2, 256), jnp.float32), q, implementation="xla_dot")
    assert registry.order(api.CANDIDATES, "gpu") == ("xla_dot", registry.REFERENCE)


# The MX and NVFP4 kinds as the op's spec draws them (random codes, scales and global scales).
MX_NV_KINDS = {"mxfp4": (32, "uint8"), "nvfp4": (16, "float8_e4m3fn"), "nvfp4_modelopt": (16, "float8_e4m3fn"),
               "mxfp8_e4m3": (32, "uint8"), "mxfp8_e5m2": (32, "uint8")}


@pytest.mark.parametrize("R, O, I", [(1, 37, 256), (7, 96, 512), (128, 33, 64)])  # passes of 1; 4, 2, 1; 8 rows
@pytest.mark.parametrize("kind", sorted(MX_NV_KINDS))
def test_cpu_kernel_matches_the_reference_on_mx_and_nvfp4_spec_cases(kind, R, O, I):
    """The kernel's weights are the reference's (the same e2m1 table times the same float32 step, NVFP4's within a
    unit of it, or the same float8 value times the same power of two); only the order of the float32 sum differs.
    Largest error seen against the reference, relative to its largest output: 7.1e-7 (mxfp4, 7 x 512); against the
    float64 product 1.4e-7, where the reference's own is 7.4e-7."""
    group, scale_dtype = MX_NV_KINDS[kind]
    (x, q), _ = spec.build(cases.Random(R, False), jnp.float32, R=R, O=O, I=I, kind=kind, group=group,
                           offset=False, scale_dtype=scale_dtype)
    got = np.asarray(jax.jit(cpu_ffi.quantized_matmul)(x, q), np.float64)
    want = np.asarray(reference.quantized_matmul(x, q), np.float64)
    assert got.shape == (R, O)
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
    assert_float32_tight(got, x, q, f"cpu_ffi {kind} {R} x [{O} x {I}]")


def fp4_bytes(codes: np.ndarray) -> np.ndarray:
    """[O, I] e2m1 codes 0..15 -> [O, I/2] bytes as MXFP4 and NVFP4 ship them: element 2i low, 2i + 1 high."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


# The e2m1 values by code, written out from the format (sign bit 3; exponent bits 1..2, bias 1; mantissa bit 0).
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def hand_built_fp4(kind: str) -> tuple[QuantizedWeight, np.ndarray]:
    """A [3, 64] FP4 weight whose every element has a code of its own pattern and whose scales vary per block, with
    the float32 weight it stands for computed here from the formats' definitions (not from `reference`)."""
    O, I = 3, 64
    codes = (np.arange(I)[None, :] * 7 + np.arange(O)[:, None] * 3) % 16  # neighbours differ: order shows
    values = np.array(E2M1_VALUES, np.float32)[codes]
    if kind == "mxfp4":
        exponents = np.array([[100, 127], [131, 140], [126, 118]], np.uint8)  # 2^-27 .. 2^13
        step = np.array([[2.0 ** (int(e) - 127) for e in row] for row in exponents], np.float32)
        q = QuantizedWeight(jnp.asarray(fp4_bytes(codes)), jnp.asarray(exponents), None, kind, 32)
    else:  # e4m3 scales 0.5 .. 448 and a subnormal (2^-9 * 3), divided by (ModelOpt: times) a global scale
        scale = np.array([[0.5, 1.5, 3.25, 448.0], [0.005859375, 1.0, 2.0, 26.0], [0.75, 96.0, 5.0, 0.125]],
                         np.float32)
        glob = np.array([[3.0], [0.1], [7.0]], np.float32)
        step = scale / glob if kind == "nvfp4" else scale * glob  # float32, as the format defines it
        q = QuantizedWeight(jnp.asarray(fp4_bytes(codes)), jnp.asarray(scale.astype(ml_dtypes.float8_e4m3fn)), None,
                            kind, 16, jnp.asarray(glob))
    group = q.group
    return q, values * np.repeat(step, group, axis=1)


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4", "nvfp4_modelopt"])
def test_cpu_kernel_reads_fp4_nibbles_and_scales_exactly(kind):
    """Unit vectors read each weight back alone, so the outputs are the weights bit for bit: a swapped nibble order,
    int4's layout, or a scale decoded with the wrong bias or rounding fails. (The reference agrees within one float32
    unit: XLA rewrites its division by the global scale as a product with the reciprocal, which rounds twice; the
    kernel divides, as compressed-tensors and the converter's --dequantize do.)"""
    q, want = hand_built_fp4(kind)
    np.testing.assert_array_max_ulp(np.asarray(reference.dequantize(q)), want, maxulp=0 if kind == "mxfp4" else 1)
    x = jnp.eye(64, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(cpu_ffi.quantized_matmul(x, q)), want.T)
    np.testing.assert_array_equal(np.asarray(cpu_ffi.quantized_matmul(x[5:6], q)), want.T[5:6])  # one-row pass


@pytest.mark.parametrize("kind", ["mxfp8_e4m3", "mxfp8_e5m2"])
def test_cpu_kernel_reads_every_mxfp8_code_exactly(kind):
    """Every finite float8 code of the kind, times E8M0 scales 2^-20 .. 2^10, read back through unit vectors."""
    dtype = reference.CODE_DTYPES[kind]
    codes = np.arange(256, dtype=np.uint8).view(dtype).reshape(2, 128)
    codes = np.where(np.isfinite(codes.astype(np.float32)), codes, np.zeros_like(codes))
    exponents = np.array([[107, 127, 130, 137], [120, 127, 128, 110]], np.uint8)
    want = codes.astype(np.float32) * np.repeat(np.ldexp(np.float32(1), exponents.astype(np.int32) - 127), 32, 1)
    q = QuantizedWeight(jnp.asarray(codes), jnp.asarray(exponents), None, kind, 32)
    np.testing.assert_array_equal(np.asarray(reference.dequantize(q)), want)
    got = np.asarray(cpu_ffi.quantized_matmul(jnp.eye(128, dtype=jnp.float32), q))
    np.testing.assert_array_equal(got, want.T)


def test_cpu_kernel_declines_mx_scales_of_another_dtype():
    q, _ = hand_built_fp4("mxfp4")
    widened = QuantizedWeight(q.codes, q.scale.astype(jnp.float32), None, "mxfp4", 32)
    with pytest.raises(registry.KernelUnavailable, match="mxfp4 codes uint8 and scales float32"):
        api.quantized_matmul(jnp.ones((1, 64)), widened, implementation="cpu_ffi")


def test_cpu_kernel_serves_more_rows_than_a_pass_keeps_in_registers_and_odd_feature_counts():
    _, q = weight("int4-offset-f16", O=37, I=96)  # 37 features: not a multiple of the chunk or the vector width
    x = jnp.asarray(np.random.default_rng(1).standard_normal((11, 96)), jnp.float32)
    assert_float32_tight(api.quantized_matmul(x, q, implementation="cpu_ffi"), x, q, "37 features x 11 rows")


def gguf_blocks(type_name: str, rows: int, values: int) -> np.ndarray:
    """[rows, bytes] of GGUF blocks: the gguf package's quantizer where it has one, else random bytes (every bit
    pattern is a valid code, scale or min) with finite float16 super-block scales."""
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    rng = np.random.default_rng(2)
    try:
        return gguf.quants.quantize(rng.standard_normal((rows, values)).astype(np.float32), qtype)
    except NotImplementedError:
        pass
    fmt = gguf_blocks_lib.FORMATS[int(qtype)]
    raw = rng.integers(0, 256, (rows, values // fmt.block, fmt.block_bytes), dtype=np.uint8)
    where = {"Q6_K": [208], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q3_K": [108], "Q2_K": [80, 82]}[type_name]  # d, dmin
    for at in where:
        raw[..., at:at + 2] = np.float16(rng.uniform(1e-3, 1e-2)).reshape(1).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                                       "Q6_K"])
def test_gguf_blocks_dequantize_bitwise_like_the_gguf_package(type_name):
    """Blocks kept (or re-blocked) as the converter stores them dequantize exactly as the gguf package's math, and
    the CPU kernel computes with them float32-tight."""
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    raw = gguf_blocks(type_name, 6, 512)
    fmt = gguf_blocks_lib.FORMATS[int(qtype)]
    codes, scale, offset = gguf_blocks_lib.reblock(int(qtype), raw)
    q = QuantizedWeight(jnp.asarray(codes), jnp.asarray(scale), None if offset is None else jnp.asarray(offset),
                        fmt.kind, fmt.group)
    np.testing.assert_array_equal(np.asarray(reference.dequantize(q)), gguf.quants.dequantize(raw, qtype))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((3, 512)), jnp.float32)
    assert_float32_tight(api.quantized_matmul(x, q, implementation="cpu_ffi"), x, q, type_name)


def test_every_quantized_gguf_type_read_is_kept():
    """The GGUF header accepts float types and types with a kept format, nothing in between."""
    from convert import gguf_source

    assert set(gguf_source.SUPPORTED_TYPES) == set(gguf_source.FLOAT_TYPES) | set(gguf_blocks_lib.FORMATS)


def test_fp8_codes_dequantize_bitwise_like_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).reshape(2, 128)
    codes = np.where(np.isnan(codes.astype(np.float32)), np.zeros_like(codes), codes)  # the one NaN pattern
    scale = np.array([[0.5], [3.0]], np.float32)
    q = QuantizedWeight(jnp.asarray(codes), jnp.asarray(scale), None, "fp8", 128)
    want = codes.astype(np.float32) * scale
    np.testing.assert_array_equal(np.asarray(reference.dequantize(q)), want)
    x = jnp.eye(128, dtype=jnp.float32)[:8]  # the kernel's conversion, read back through unit vectors
    got = np.asarray(api.quantized_matmul(x, q, implementation="cpu_ffi"))
    np.testing.assert_array_equal(got, want[:, :8].T)


@pytest.mark.parametrize("name", sorted(n for n, f in FORMATS.items() if f[0] != "int8" or not f[2]))
def test_round_to_nearest_stays_within_half_a_step(name):
    kind, group, offsets, _ = FORMATS[name]
    w, q = weight(name)
    error = np.abs(np.asarray(reference.dequantize(q)) - w).reshape(80, -1, group)
    step = np.abs(np.asarray(q.scale, np.float32))[..., None]
    if kind == "int4" and not offsets:  # as Q4_0: codes reach 8 steps one way and 7 the other, so one step
        assert (error <= step * (1 + 127 * 2 ** -8) + 1e-7).all(), error.max()
    elif kind == "fp8":  # three mantissa bits: half a unit in the last place, relative to each value
        assert (error <= np.abs(w).reshape(error.shape) * 2 ** -4 + step * 2 ** -9 + 1e-7).all()
    else:  # half a step, and a bfloat16 scale's rounding on the group's extreme codes
        assert (error <= step * (0.5 + 127 * 2 ** -8) + 1e-7).all(), error.max()


def test_quantize_refuses_groups_that_do_not_divide_the_inputs():
    with pytest.raises(ValueError, match="group size 48"):
        reference.quantize(np.ones((4, 64), np.float32), "int8", 48)
    with pytest.raises(ValueError, match="kind 'int3'"):
        reference.quantize(np.ones((4, 64), np.float32), "int3", 32)
