"""The Qwen3-VL vision tower against transformers' `Qwen3VLVisionModel` in float32: weights loaded through the
tower's HF mapping, merged embeddings and DeepStack features compared on images of several grids."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from conftest import run_reference
from day0jax.core.errors import UnsupportedArchitecture
from day0jax.core.hf_tensors import default_source
from day0jax.models import param_infos
from day0jax.vision import qwen_vit
from day0jax.vision.qwen_vit import VisionConfig, VisionModel, hf_source

CONFIG = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, in_channels=3, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=16,
              deepstack_visual_indexes=[0, 1], hidden_act="gelu_pytorch_tanh")
# A 4 x 4 position table resampled up in w, up in h, kept (a two-frame clip: attention per frame, positions
# repeated per frame), and down in h while up in w.
GRIDS = ((1, 4, 6), (1, 8, 4), (2, 4, 4), (1, 2, 6))
# float32 throughout; the two sides differ in summation order only (the matmuls, LayerNorm, softmax and the
# 4-tap position sum), about 1e-7 relative per operation, grown over 3 blocks and a merger to well under 1e-5.
RTOL = 1e-5


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """transformers' tiny tower: its state dict (numpy) and its inputs and outputs."""
    root = tmp_path_factory.mktemp("qwen_vit")
    run_reference([{"op": "qwen3_vl_vision", "config": CONFIG, "seed": 0, "grids": [list(g) for g in GRIDS],
                    "out": str(root)}], root)
    return load_file(str(root / "model.safetensors")), dict(np.load(root / "outputs.npz"))


def load(model: nnx.Module, tensors: dict[str, np.ndarray]) -> None:
    """Fills every parameter of `model` from HF `tensors` through `hf_source`/`default_source`, as the converter
    does: each named tensor must exist with the Source's shape, and every tensor must be used."""
    used = set()
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    for info in param_infos(model):
        src = hf_source(info.path, info.shape, info.metadata) or default_source(info.path, info.shape, info.metadata)
        arrays = []
        for name, want in zip(src.names, src.shapes):
            assert name in tensors, f"{name} (for {info.path}) is not in the checkpoint"
            assert tensors[name].shape == tuple(want), (name, tensors[name].shape, want)
            arrays.append(tensors[name])
            used.add(name)
        value = src.combine(arrays, info.shape)
        assert value.shape == info.shape, (info.path, value.shape, info.shape)
        flat[tuple(int(p) if p.isdigit() else p for p in info.path.split("."))].set_value(jnp.asarray(value))
    assert used == set(tensors), f"unused checkpoint tensors: {sorted(set(tensors) - used)}"
    nnx.update(model, state)


def build(config: VisionConfig) -> VisionModel:
    with nnx.use_eager_sharding(False):  # logical axis names, no mesh: as models.abstract_model builds
        return VisionModel(config, dtype=jnp.float32, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tower(ref):
    model = build(VisionConfig.from_hf(CONFIG))
    load(model, ref[0])
    return model


def rel_error(got, want) -> float:
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


def errors(tower, out, grids=GRIDS) -> list[float]:
    """Relative errors of the merged embeddings, then of each DeepStack feature, against transformers'."""
    embeds, deepstack = tower(jnp.asarray(out["patches"]), grids)
    assert len(deepstack) == len(CONFIG["deepstack_visual_indexes"])
    return [rel_error(embeds, out["embeds"])] + [rel_error(d, out[f"deepstack_{i}"]) for i, d in enumerate(deepstack)]


def test_matches_transformers(tower, ref):
    out = ref[1]
    assert [tuple(g) for g in out["grids"]] == list(GRIDS)
    P = sum(t * h * w for t, h, w in GRIDS)
    assert out["embeds"].shape == (P // 4, CONFIG["out_hidden_size"])
    # Jitted as a caller would, grids static: one program for this grid tuple.
    graph, state = nnx.split(tower)
    run = jax.jit(lambda s, x: nnx.merge(graph, s)(x, GRIDS))
    embeds, deepstack = run(state, jnp.asarray(out["patches"]))
    errs = [rel_error(embeds, out["embeds"])] + [rel_error(d, out[f"deepstack_{i}"]) for i, d in enumerate(deepstack)]
    print("max relative errors (embeds, deepstack...):", errs)
    assert max(errs) <= RTOL, errs


@pytest.mark.parametrize("broken", ["raster_position_table", "no_interpolation", "no_rotary", "rotary_raster",
                                    "one_segment"])
def test_each_grid_dependence_is_checked(tower, ref, monkeypatch, broken):
    """Each grid-dependent piece, done wrong, moves the outputs far past the tolerance: the comparison can fail."""
    merge, side = CONFIG["spatial_merge_size"], 4
    if broken == "raster_position_table":  # interpolation without the merge-order permutation
        taps = qwen_vit.interpolation_taps(GRIDS, side, 1)
        monkeypatch.setattr(qwen_vit, "interpolation_taps", lambda grids, s, m: taps)
    elif broken == "no_interpolation":  # nearest table row, as if every grid were 4 x 4
        idx, w = qwen_vit.interpolation_taps(GRIDS, side, merge)
        nearest = np.take_along_axis(idx, w.argmax(-1)[:, None], -1)
        monkeypatch.setattr(qwen_vit, "interpolation_taps",
                            lambda grids, s, m: (np.repeat(nearest, 4, -1), np.full_like(w, 0.25)))
    elif broken == "no_rotary":
        positions = qwen_vit.rotary_positions(GRIDS, merge)
        monkeypatch.setattr(qwen_vit, "rotary_positions", lambda grids, m: np.zeros_like(positions))
    elif broken == "rotary_raster":
        positions = qwen_vit.rotary_positions(GRIDS, 1)
        monkeypatch.setattr(qwen_vit, "rotary_positions", lambda grids, m: positions)
    else:  # every patch attends to every other, across images and frames
        P = sum(t * h * w for t, h, w in GRIDS)
        monkeypatch.setattr(qwen_vit, "frame_segments", lambda grids: np.zeros(P, np.int32))
    errs = errors(tower, ref[1])
    assert errs[0] > 100 * RTOL, (broken, errs)


def test_config_refusals():
    with pytest.raises(UnsupportedArchitecture, match="window_size"):
        VisionConfig.from_hf(dict(CONFIG, window_size=112))
    with pytest.raises(UnsupportedArchitecture, match="rope_type"):
        VisionConfig.from_hf(dict(CONFIG, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    with pytest.raises(UnsupportedArchitecture, match="deepstack_visual_indexes"):
        VisionConfig.from_hf(dict(CONFIG, deepstack_visual_indexes=[1, 5]))
    with pytest.raises(UnsupportedArchitecture, match="patch_size"):
        VisionConfig.from_hf(dict(CONFIG, patch_size=[4, 4]))
    with pytest.raises(UnsupportedArchitecture, match="hidden_act"):
        VisionConfig.from_hf(dict(CONFIG, hidden_act="nope"))
    # HF's aliases, ignored keys, and Qwen3.5's tower (no DeepStack) are accepted.
    hf = {k: v for k, v in CONFIG.items() if k not in ("num_heads", "depth")}
    c = VisionConfig.from_hf(dict(hf, num_attention_heads=4, num_hidden_layers=2, initializer_range=0.1,
                                  model_type="qwen3_5", rope_theta=500.0))
    assert (c.num_heads, c.depth, c.deepstack_layers, c.theta) == (4, 2, (), 500.0)
    assert not nnx.state(build(c).deepstack_merger_list, nnx.Param)


def test_bad_grids(tower, ref):
    patches = jnp.asarray(ref[1]["patches"])
    with pytest.raises(ValueError, match="merge"):
        tower(patches[:20], ((1, 4, 5),))
    with pytest.raises(ValueError, match="expected"):
        tower(patches, ((1, 4, 6),))


def test_buckets_cover_the_image_processors_limit():
    """Without a limit, the default sizes; with one, the buckets up to the one that holds it, doubling past the
    largest size as `bucket` grows: every image up to the limit has its program among `keys`."""
    buckets = qwen_vit.PatchBuckets(VisionConfig.from_hf(CONFIG))
    assert buckets.keys() == [(256,), (512,), (1024,), (2048,), (4096,)]
    small = qwen_vit.PatchBuckets(VisionConfig.from_hf(CONFIG), limit=200)
    assert small.keys() == [(256,)]
    big = qwen_vit.PatchBuckets(VisionConfig.from_hf(CONFIG), limit=20000)
    assert big.keys() == [(256,), (512,), (1024,), (2048,), (4096,), (8192,), (16384,), (32768,)]
    assert all((big.bucket(n),) in big.keys() for n in (1, 300, 1656, 5000, 16385, 20000))
    assert big.bucket(1656) == 2048 and big.bucket(20000) == 32768
