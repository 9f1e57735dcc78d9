"""The paged decode attention op's shared contract test, run by every implementation that can run here.

bfloat16 inputs against the float32 reference on the same values; tolerance `cases.TOLERANCE["bfloat16"]`
(2e-2 of the largest output magnitude). The Mosaic GPU kernel runs in the interpreter on the CPU (on every
machine) and, compiled, on a Hopper GPU; the cases make it split rows' keys (some splits empty), gather several
pages per key block, and need several query tiles (a prefill chunk's tiles each visit only their own key range).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import needs_hopper
from kernels_pallas import cases, registry, selftest
from kernels_pallas.paged_attention import api, fp8, pallas_mgpu, reference, xla_blocks

CASES = {
    # 2 rows of very different lengths over 16-token pages: 4 pages per key block, splits with no work.
    "gqa-decode-pages16": dict(B=2, T=1, N=8, K=2, H=64, page=16, max_len=150, scale=None, window=None,
                               softcap=None, sinks=False),
    # 3 new tokens x 32 heads on one kv head: 96 query rows, two 64-row tiles; window, soft-cap, sinks.
    "mqa-multitoken-window-softcap-sinks": dict(B=1, T=3, N=32, K=1, H=128, page=64, max_len=150, scale=0.1,
                                                window=40, softcap=20.0, sinks=True),
    # A prefill chunk of 40 tokens x 4 heads: 3 query tiles, each with its own key range under a 48-token window.
    "gqa-prefill-chunk-tiles-window": dict(B=2, T=40, N=8, K=2, H=64, page=16, max_len=200, scale=None, window=48,
                                           softcap=None, sinks=False),
}


class PagedAttentionContract:
    implementation: str

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_matches_reference(self, name):
        case = cases.Case("paged_attention", name, "bfloat16", CASES[name])
        args, kwargs = case.build(10 + sorted(CASES).index(name))
        got = selftest.run(functools.partial(api.paged_attention, implementation=self.implementation), args, kwargs)
        want = selftest.run(reference.paged_attention, cases.upcast(args), kwargs)
        assert got.shape == args[0].shape and got.dtype == args[0].dtype
        err = cases.max_relative_error(got, want)
        assert err <= case.tolerance, f"{self.implementation} on {name}: max relative error {err}"


class TestReference(PagedAttentionContract):
    implementation = "reference"


@pytest.mark.usefixtures("interpreter_on_cpu")
class TestMosaicGpuInterpret(PagedAttentionContract):
    implementation = "mosaic_gpu_interpret"


@needs_hopper
class TestMosaicGpu(PagedAttentionContract):
    implementation = "mosaic_gpu"


@pytest.mark.parametrize("window", [None, 100])
def test_each_query_tile_visits_exactly_the_key_blocks_its_tokens_see(window):
    """A prefill chunk of 256 tokens x 4 heads (16 tiles) after 3840 cached keys, and a shorter ragged row: every
    visible key lies in its tile's blocks, and the first and last of those blocks hold one (no wasted block)."""
    T, G, bkv, lengths = 256, 4, 64, np.array([4096, 1000])
    pos = lengths[:, None] - T + np.arange(T)[None]
    row_pos = np.repeat(pos, G, axis=1).astype(np.int32)  # already whole tiles: 1024 rows
    lo, hi, first, last = map(np.asarray, pallas_mgpu.tile_key_blocks(
        jnp.asarray(row_pos), jnp.asarray(lengths, jnp.int32), window, bkv, num_blocks=4096 // bkv))
    assert lo.shape == (2, 16)
    for b in range(2):
        for tile in range(16):
            qpos = row_pos[b, tile * 64:(tile + 1) * 64]
            key = np.arange(lengths[b])
            seen = (key[None] <= qpos[:, None]) & (True if window is None else qpos[:, None] - key[None] < window)
            blocks = np.unique(np.nonzero(seen.any(0))[0] // bkv)
            assert (lo[b, tile], hi[b, tile]) == (blocks.min(), blocks.max() + 1), (b, tile)
            assert (first[b, tile], last[b, tile]) == (qpos.min(), qpos.max())
    assert (hi[0] - lo[0]).sum() < 16 * (hi[0] - lo[0]).max()  # less than the whole chunk's rectangle


def test_prefill_chunk_lowers_for_cuda():
    """Llama-3-8B's prefill chunk of 256 tokens (16 query tiles, each its own key range) after 3840 cached keys."""
    from kernels_pallas import selfcheck

    spec = dict(B=2, T=256, N=32, K=8, H=128, page=16, max_len=4096, scale=None, window=None, softcap=None,
                sinks=False)
    rows = selfcheck.lower_rows([cases.Case("paged_attention", "prefill chunk", "bfloat16", spec)], "cuda")
    assert [r["ok"] for r in rows] == [True], rows


def test_split_count_fills_the_chip_but_never_exceeds_the_blocks():
    assert pallas_mgpu.num_splits(batch=1, kv_heads=8, num_blocks=64, cores=132, max_splits=16) == 16
    assert pallas_mgpu.num_splits(batch=256, kv_heads=8, num_blocks=64, cores=132, max_splits=16) == 1
    assert pallas_mgpu.num_splits(batch=1, kv_heads=1, num_blocks=3, cores=132, max_splits=16) == 3


def test_declines_chunked_attention_and_falls_back():
    """Chunked local attention (Llama 4) is not in the kernel: it declines it by name, and the op runs the reference."""
    args, kwargs = cases.Case("paged_attention", "chunked", "bfloat16", dict(CASES["gqa-decode-pages16"], chunk=32)
                              ).build(0)
    assert kwargs["chunk_size"] == 32
    with pytest.raises(registry.KernelUnavailable, match="chunk"):
        api.paged_attention(*args, **kwargs, implementation="mosaic_gpu_interpret")
    got = selftest.run(api.paged_attention, args, kwargs)
    want = selftest.run(reference.paged_attention, cases.upcast(args), kwargs)
    assert cases.max_relative_error(got, want) <= cases.TOLERANCE["bfloat16"]


def test_declines_fp8_pages():
    """The Mosaic kernel does not read fp8 pages (`fp8.QuantPages`, even ones read back as bfloat16): it declines
    them by name, and the key-block loop or the reference serves them."""
    q = jnp.ones((1, 1, 4, 64), jnp.bfloat16)
    k_pages, v_pages = (fp8.QuantPages(*fp8.quantize(jnp.ones((3, 16, 1, 64))), "bfloat16") for _ in range(2))
    tables, lengths, pos = jnp.array([[1, 2]]), jnp.array([20]), jnp.array([[19]])
    with pytest.raises(registry.KernelUnavailable, match="fp8"):
        api.paged_attention(q, k_pages, v_pages, tables, lengths, pos, implementation="mosaic_gpu_interpret")


def test_fp8_decode_lowers_for_cuda_through_the_key_blocks():
    """A GPU's fp8 decode step (the Mosaic kernel declines it) over 200 pages: the key-block loop lowers for cuda."""
    B, N, K, H, page, W = 2, 8, 2, 128, 16, 200
    pages = fp8.QuantPages(jax.ShapeDtypeStruct((B * W + 1, page, K, H), jnp.float8_e4m3fn),
                           jax.ShapeDtypeStruct((B * W + 1, page, K), jnp.float32), "bfloat16")
    args = (jax.ShapeDtypeStruct((B, 1, N, H), jnp.bfloat16), pages, pages, jax.ShapeDtypeStruct((B, W), jnp.int32),
            jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B, 1), jnp.int32))
    blocks = jax.jit(functools.partial(api.paged_attention, implementation="xla_blocks"))
    assert "stablehlo.while" in jax.export.export(blocks, platforms=("cuda",))(*args).mlir_module()


def test_declines_mla_pools_and_falls_back():
    q = jnp.ones((1, 1, 4, 64), jnp.bfloat16)
    k_pages, v_pages = jnp.ones((3, 16, 1, 64), jnp.bfloat16), jnp.ones((3, 16, 1, 128), jnp.bfloat16)
    tables, lengths, pos = jnp.array([[1, 2]]), jnp.array([20]), jnp.array([[19]])
    with pytest.raises(registry.KernelUnavailable, match="one shape"):
        api.paged_attention(q, k_pages, v_pages, tables, lengths, pos, implementation="mosaic_gpu_interpret")
    out = api.paged_attention(q, k_pages, v_pages, tables, lengths, pos)  # value head dim 128 (MLA): reference
    assert out.shape == (1, 1, 4, 128)
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0)


# The CPU's key-block candidate in float32 against the reference: chunks of queries over tables several blocks wide
# (the last block partial), rows of different lengths, every variant of the contract.
BLOCK_CASES = {
    "gqa-rows-of-different-lengths": dict(B=2, T=40, N=8, K=2, H=32, page=16, max_len=700, scale=None, window=None,
                                          softcap=None, sinks=False),
    "mqa-window-softcap-sinks": dict(B=1, T=24, N=4, K=1, H=32, page=16, max_len=600, scale=0.1, window=100,
                                     softcap=20.0, sinks=True),
    "chunked-local": dict(B=2, T=16, N=4, K=2, H=16, page=16, max_len=520, scale=None, window=None, softcap=None,
                          sinks=False, chunk=96),
}
BLOCKS_TOLERANCE = 1e-5  # float32: the online softmax sums blocks in another order than the one-pass reference


def widened(args: tuple, pages: int) -> tuple:
    """The case's inputs with block tables `pages` wide: columns past each row's pages at the trash page, as a width
    bucket larger than the rows leaves them."""
    q, k_pages, v_pages, tables, lengths, positions = args
    tables = jnp.pad(tables, ((0, 0), (0, pages - tables.shape[1])))
    return q, k_pages, v_pages, tables, lengths, positions


@pytest.mark.parametrize("name", sorted(BLOCK_CASES))
def test_blocks_match_the_reference(name):
    case = cases.Case("paged_attention", name, "float32", BLOCK_CASES[name])
    args, kwargs = case.build(20 + sorted(BLOCK_CASES).index(name))
    assert args[3].shape[1] > xla_blocks.BLOCK_PAGES  # several blocks, or the candidate declines
    for table_pages in (args[3].shape[1], 4 * xla_blocks.BLOCK_PAGES + 3):  # exact, and a wide bucket
        wide = widened(args, table_pages)
        got = selftest.run(functools.partial(api.paged_attention, implementation="xla_blocks"), wide, kwargs)
        want = selftest.run(reference.paged_attention, wide, kwargs)
        err = cases.max_relative_error(got, want)
        assert err <= BLOCKS_TOLERANCE, f"xla_blocks on {name}, {table_pages} pages: max relative error {err}"


def test_blocks_with_bidirectional_spans_match_the_reference():
    """`visible_until` (Gemma 3's image tokens): queries of a span see its later keys, across a block boundary."""
    args, kwargs = cases.Case("paged_attention", "span", "float32", BLOCK_CASES["gqa-rows-of-different-lengths"]
                              ).build(7)
    positions = np.asarray(args[5])
    lo, hi = positions[:, 5:6], positions[:, 30:31]  # keys lo..hi of each row form one span
    inside = (positions >= lo) & (positions <= hi)
    kwargs = dict(kwargs, visible_until=jnp.asarray(np.where(inside, hi, positions).astype(np.int32)))
    got = selftest.run(functools.partial(api.paged_attention, implementation="xla_blocks"), args, kwargs)
    want = selftest.run(reference.paged_attention, args, kwargs)
    assert cases.max_relative_error(got, want) <= BLOCKS_TOLERANCE


@pytest.mark.parametrize("window", [None, 64])
def test_blocks_read_no_page_outside_the_rows_and_the_window(window):
    """Pages that only columns past the longest row (or blocks wholly before every window) point at hold NaN: the
    reference, which scores every column, turns NaN; the blocks never read them."""
    B, T, N, K, H, page, length = 1, 8, 2, 1, 16, 16, 600
    used, width = -(-length // page), 6 * xla_blocks.BLOCK_PAGES  # 38 pages of a 96-page bucket
    rng = np.random.default_rng(3)
    k_pages = rng.standard_normal((width + 1, page, K, H)).astype(np.float32)
    v_pages = rng.standard_normal((width + 1, page, K, H)).astype(np.float32)
    tables = np.arange(1, width + 1, dtype=np.int32)[None]  # every column its own page
    per_block = xla_blocks.BLOCK_PAGES
    poisoned = list(range(-(-used // per_block) * per_block, width))  # the blocks after the row's last one
    if window is not None:
        poisoned += list(range(per_block))  # keys 0-255; the window starts at key 529
    k_pages[tables[0, poisoned]] = np.nan
    v_pages[tables[0, poisoned]] = np.nan
    positions = (length - T + np.arange(T, dtype=np.int32))[None]
    args = (jnp.asarray(rng.standard_normal((B, T, N, H)).astype(np.float32)), jnp.asarray(k_pages),
            jnp.asarray(v_pages), jnp.asarray(tables), jnp.array([length], jnp.int32), jnp.asarray(positions))
    kwargs = dict(sliding_window=window)
    got = np.asarray(selftest.run(functools.partial(api.paged_attention, implementation="xla_blocks"), args, kwargs))
    assert np.isnan(np.asarray(selftest.run(reference.paged_attention, args, kwargs))).all()
    clean = (args[0], jnp.nan_to_num(args[1]), jnp.nan_to_num(args[2])) + args[3:]
    want = np.asarray(selftest.run(reference.paged_attention, clean, kwargs))
    assert np.isfinite(got).all() and cases.max_relative_error(got, want) <= BLOCKS_TOLERANCE


@pytest.mark.parametrize("name", ["gqa-rows-of-different-lengths", "mqa-window-softcap-sinks"])
def test_blocks_decode_over_long_tables_matches_the_reference(name):
    """Decode steps (one query per row) over tables wider than one decode block: rows of different lengths, the
    table exact and as a wider bucket."""
    spec = dict(BLOCK_CASES[name], B=3, T=1, max_len=2100)  # 132 pages: three 64-page blocks, the last partial
    args, kwargs = cases.Case("paged_attention", name, "float32", spec).build(11)
    assert args[3].shape[1] > xla_blocks.DECODE_BLOCK_PAGES
    for table_pages in (args[3].shape[1], 4 * xla_blocks.DECODE_BLOCK_PAGES + 3):
        wide = widened(args, table_pages)
        got = selftest.run(functools.partial(api.paged_attention, implementation="xla_blocks"), wide, kwargs)
        want = selftest.run(reference.paged_attention, wide, kwargs)
        err = cases.max_relative_error(got, want)
        assert err <= BLOCKS_TOLERANCE, f"xla_blocks decode on {name}, {table_pages} pages: max relative error {err}"



def test_blocks_decline_tables_of_one_block():
    """Tables of one block (64 pages for a decode step, 16 for a prefill chunk) gain nothing from the loop: it
    declines them by name; the op runs the reference (decode steps take the CPU kernel before either)."""
    for T, max_len in ((1, 700), (4, 200)):
        spec = dict(BLOCK_CASES["gqa-rows-of-different-lengths"], T=T, max_len=max_len)
        args, kwargs = cases.Case("paged_attention", "declined", "float32", spec).build(0)
        with pytest.raises(registry.KernelUnavailable, match="one block"):
            api.paged_attention(*args, **kwargs, implementation="xla_blocks")
        want = "cpu_ffi" if T == 1 and jax.default_backend() == "cpu" else registry.REFERENCE
        assert registry.chosen("paged_attention", *args, **kwargs) == want


# The CPU's decode kernel (one query per row): every variant of the contract at T=1, rows of different lengths, the
# table exact and as a wider bucket; float32 against the reference within summation-order rounding, bfloat16 within
# the contract's tolerance.
DECODE_CASES = {name: dict(spec, T=1) for name, spec in {**CASES, **BLOCK_CASES}.items()}
DECODE_TOLERANCE = 1e-5  # float32: the same softmax (maximum subtracted), summed in another order


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(DECODE_CASES))
def test_cpu_kernel_decode_matches_the_reference(name, dtype):
    case = cases.Case("paged_attention", name, dtype, DECODE_CASES[name])
    args, kwargs = case.build(30 + sorted(DECODE_CASES).index(name))
    for table_pages in (args[3].shape[1], 2 * args[3].shape[1] + 3):
        wide = widened(args, table_pages)
        got = selftest.run(functools.partial(api.paged_attention, implementation="cpu_ffi"), wide, kwargs)
        want = selftest.run(reference.paged_attention, cases.upcast(wide), kwargs)
        assert got.shape == args[0].shape and got.dtype == args[0].dtype
        err = cases.max_relative_error(got, want)
        tolerance = DECODE_TOLERANCE if dtype == "float32" else case.tolerance
        assert err <= tolerance, f"cpu_ffi on {name} ({dtype}), {table_pages} pages: max relative error {err}"


def decode_args(lengths, positions, *, N=4, K=2, H=64, page=16, seed=0):
    """float32 decode inputs: rows of `lengths` cached keys, queries at `positions`, each row's pages its own."""
    rng = np.random.default_rng(seed)
    B, width = len(lengths), -(-max(lengths) // page)
    tables = np.arange(1, B * width + 1, dtype=np.int32).reshape(B, width)
    pages = B * width + 1
    return (jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.float32),
            jnp.asarray(rng.standard_normal((pages, page, K, H)), jnp.float32),
            jnp.asarray(rng.standard_normal((pages, page, K, H)), jnp.float32), jnp.asarray(tables),
            jnp.asarray(lengths, jnp.int32), jnp.asarray(positions, jnp.int32).reshape(B, 1))


def test_cpu_kernel_decode_sees_a_bidirectional_span_past_the_query():
    """`visible_until` beyond a query's own position (Gemma 3's image tokens): it sees the span's later keys."""
    args = decode_args([300, 200], [250, 120])
    kwargs = dict(visible_until=jnp.array([[280], [150]], jnp.int32), sliding_window=100)
    got = selftest.run(functools.partial(api.paged_attention, implementation="cpu_ffi"), args, kwargs)
    want = selftest.run(reference.paged_attention, args, kwargs)
    assert cases.max_relative_error(got, want) <= DECODE_TOLERANCE
    without = selftest.run(reference.paged_attention, args, dict(sliding_window=100))
    assert cases.max_relative_error(got, without) > 1e-3  # the span's keys changed the answer


@pytest.mark.parametrize("mask", [dict(sliding_window=40), dict(chunk_size=64)])
def test_cpu_kernel_decode_reads_only_the_keys_a_query_sees(mask):
    """Pages holding no key the query sees (before its window or chunk, after its position, past its length) hold
    NaN: the reference, which scores every column, turns NaN; the kernel never reads them."""
    length, position, page = 400, 330, 16
    args = decode_args([length], [position], page=page)
    q, k_pages, v_pages, tables = args[:4]
    first = position - 40 + 1 if "sliding_window" in mask else position // 64 * 64
    unseen = [p for p in range(tables.shape[1]) if (p + 1) * page <= first or p * page > position]
    k_pages = k_pages.at[tables[0, jnp.array(unseen)]].set(jnp.nan)
    v_pages = v_pages.at[tables[0, jnp.array(unseen)]].set(jnp.nan)
    poisoned = (q, k_pages, v_pages) + args[3:]
    got = np.asarray(selftest.run(functools.partial(api.paged_attention, implementation="cpu_ffi"), poisoned, mask))
    assert np.isnan(np.asarray(selftest.run(reference.paged_attention, poisoned, mask))).all()
    want = selftest.run(reference.paged_attention, args, mask)
    assert np.isfinite(got).all() and cases.max_relative_error(got, want) <= DECODE_TOLERANCE


def test_cpu_kernel_decode_gives_zeros_for_rows_that_see_nothing():
    """A batch-padding row (no cached key) comes out as zeros, never NaN; the other rows as the reference."""
    args = decode_args([0, 90], [0, 89])
    got = np.asarray(selftest.run(functools.partial(api.paged_attention, implementation="cpu_ffi"), args, {}))
    want = np.asarray(selftest.run(reference.paged_attention, args, {}))
    assert (got[0] == 0).all()
    assert cases.max_relative_error(got[1], want[1]) <= DECODE_TOLERANCE


def test_cpu_kernel_declines_what_it_does_not_take():
    """Several queries per row, float16 pages and a multi-device mesh (the custom call has no partitioning rule:
    XLA would gather the pool onto every device) are declined by name; the pool then answers through the others."""
    args = decode_args([100], [99])
    prefill = (jnp.ones((1, 2, 4, 64), jnp.float32),) + args[1:5] + (jnp.array([[98, 99]], jnp.int32),)
    with pytest.raises(registry.KernelUnavailable, match="2 queries per row"):
        api.paged_attention(*prefill, implementation="cpu_ffi")
    half = (args[0], args[1].astype(jnp.float16), args[2].astype(jnp.float16)) + args[3:]
    with pytest.raises(registry.KernelUnavailable, match="float16"):
        api.paged_attention(*half, implementation="cpu_ffi")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("tp",))):
        with pytest.raises(registry.KernelUnavailable, match="mesh of 2 devices"):
            api.paged_attention(*args, implementation="cpu_ffi")
    np.testing.assert_allclose(api.paged_attention(*half), reference.paged_attention(*half), rtol=1e-3, atol=1e-3)


def fp8_pages(args: tuple) -> tuple:
    """The inputs with the key and value pools as fp8 pages (`fp8.QuantPages`)."""
    q, k_pages, v_pages, *rest = args
    return (q, fp8.QuantPages(*fp8.quantize(k_pages)), fp8.QuantPages(*fp8.quantize(v_pages)), *rest)


@pytest.mark.parametrize("name", sorted(DECODE_CASES))
def test_fp8_pages_decode_in_the_cpu_kernel_and_in_key_blocks_as_the_reference(name):
    """fp8 pages read by the CPU kernel (scales applied per key) and by the key-block loop (one block dequantized at
    a time) give the reference's attention over the same dequantized pages, within float32 summation order; the
    kernel serves fp8 decode steps."""
    case = cases.Case("paged_attention", name, "float32", DECODE_CASES[name])
    args, kwargs = case.build(40 + sorted(DECODE_CASES).index(name))
    for implementation, table_pages in (("cpu_ffi", 2 * args[3].shape[1] + 3),
                                        ("xla_blocks", 2 * xla_blocks.DECODE_BLOCK_PAGES + 3)):
        wide = fp8_pages(widened(args, table_pages))
        got = selftest.run(functools.partial(api.paged_attention, implementation=implementation), wide, kwargs)
        want = selftest.run(reference.paged_attention, wide, kwargs)
        err = cases.max_relative_error(got, want)
        assert err <= DECODE_TOLERANCE, f"{implementation} on fp8 pages, {name}: max relative error {err}"
    if jax.default_backend() == "cpu":
        assert registry.chosen("paged_attention", *fp8_pages(args), **kwargs) == "cpu_ffi"


def test_decode_steps_take_the_cpu_kernel():
    """On the CPU the pool picks the kernel for decode steps, short tables and long ones; prefill chunks go on to
    the key blocks or the reference."""
    for max_len in (100, 2100):
        args = decode_args([max_len], [max_len - 1])
        assert registry.chosen("paged_attention", *args) == "cpu_ffi" or jax.default_backend() != "cpu"


def test_mla_decode_on_a_gpu_takes_the_blockwise_program_where_the_kernel_declines():
    """DeepSeek-V3's absorbed MLA decode (keys 576 wide, values 512) over 4096 keys: the Mosaic kernel declines it,
    and on a GPU the blockwise program is tried before the reference's whole-span gather."""
    from kernels_pallas import platform

    pages, width = 2 * 256 + 1, 256
    args = (jax.ShapeDtypeStruct((2, 1, 128, 576), jnp.bfloat16), jax.ShapeDtypeStruct((pages, 16, 1, 576),
            jnp.bfloat16), jax.ShapeDtypeStruct((pages, 16, 1, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, width), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32),
            jax.ShapeDtypeStruct((2, 1), jnp.int32))
    with platform.assume(platform.HOPPER):
        assert registry.accepts("paged_attention", "mosaic_gpu", *args) is not None
        assert registry.accepts("paged_attention", "xla_blocks", *args) is None
    assert registry.order(api.CANDIDATES, "gpu") == ("mosaic_gpu", "xla_blocks", registry.REFERENCE)
