"""Image loading and preprocessing against transformers' image processors (reference venv).

Every processor type runs on odd, very wide, very tall, tiny and too-elongated images, in every colour mode, on
arrays and on PNG, JPEG, WebP and GIF data URLs. Pixel values must equal transformers' exactly: for processors with
a PIL backend, both sides run the same PIL resize on the same uint8 pixels, then the same float64/float32 numpy
steps; processors transformers has only for torchvision (Kimi K2.5's) run there as transformers' own code on a
plain-torch rendering of the torchvision functions (tests/ref/plain_torchvision), against day0jax's numpy rendering
of torch's uint8 resize kernel, which is also compared with torch's kernel alone. Two reference subprocesses (one
per backend) serve the whole module.
"""

import base64
import io
import json
import os
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from conftest import run_reference
from day0jax.core.errors import ConfigError, UnsupportedArchitecture
from day0jax.vision.images import ImageError, load_image
from day0jax.vision.processors import image_processor

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
HALF = [0.5, 0.5, 0.5]
PAS = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=8)  # the other two: Gemma3Processor's (4 crops, 1.2)


def spec(layout, config, options=None, model_processor=None, files_only=False, backend="pil", processor=None,
         ref_options=None):
    """A processor under test: its config saved as `layout` ("preprocessor": flat preprocessor_config.json,
    "processor": nested in processor_config.json as transformers 5 saves it), the options given to
    `image_processor` (the reference's call keywords), the transformers processor whose image keywords apply,
    whether it takes only the PIL images opened from files (not arrays and data URLs, which load_image makes RGB),
    and transformers' backend that defines it ("pil", or "torchvision" for processors that have no other);
    `processor`: processor_config.json's own keys beside the nested image processor, and `ref_options` the call
    keywords the model's transformers processor derives from them (day0jax derives them itself)."""
    return dict(layout=layout, config=config, options=options or {}, model_processor=model_processor,
                files_only=files_only, backend=backend, processor=processor or {}, ref_options=ref_options or {})


PROCESSORS = {
    "clip": spec("preprocessor", dict(image_processor_type="CLIPImageProcessor", size={"shortest_edge": 32},
                                      crop_size={"height": 32, "width": 32}, do_center_crop=True, resample=3,
                                      rescale_factor=0.00392156862745098, image_mean=CLIP_MEAN, image_std=CLIP_STD,
                                      processor_class="LlavaProcessor")),
    # Old-style ints, LANCZOS, a feature-extractor name instead of a type.
    "clip_legacy": spec("preprocessor", dict(feature_extractor_type="CLIPFeatureExtractor", size=30, crop_size=28,
                                             resample=1)),
    # A crop larger than the resized image (zero padding), then padding to pad_size.
    "clip_pad": spec("processor", dict(image_processor_type="CLIPImageProcessorFast", size={"shortest_edge": 24},
                                       crop_size={"height": 30, "width": 36}, do_pad=True,
                                       pad_size={"height": 33, "width": 40}, resample=2)),
    "clip_bounds": spec("preprocessor", dict(image_processor_type="CLIPImageProcessor", do_center_crop=False,
                                             size={"shortest_edge": 20, "longest_edge": 40}, resample=4)),
    # Normalizing the uint8 values themselves (rescale off by a null), NEAREST.
    "clip_maxhw": spec("preprocessor", dict(image_processor_type="CLIPImageProcessor", do_center_crop=False,
                                            size={"max_height": 30, "max_width": 40}, resample=0, do_rescale=None,
                                            image_mean=[120.0, 110.0, 100.0], image_std=[60.0, 50.0, 70.0])),
    "siglip": spec("processor", dict(image_processor_type="SiglipImageProcessor", size={"height": 28, "width": 28},
                                     resample=3, image_mean=HALF, image_std=HALF)),
    # do_convert_rgb null: no RGB conversion, so transformers refuses every mode but RGB (and so do we).
    "siglip_no_rgb": spec("preprocessor", dict(image_processor_type="SiglipImageProcessor", do_convert_rgb=None,
                                               size={"height": 20, "width": 20}), files_only=True),
    "llava": spec("preprocessor", dict(image_processor_type="LlavaImageProcessor", do_pad=True,
                                       size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30})),
    # As google/gemma-3-*-it saves it: nulls that Gemma3Processor's image keywords fill.
    "gemma3": spec("processor", dict(image_processor_type="Gemma3ImageProcessor", size={"height": 32, "width": 32},
                                     resample=2, image_mean=HALF, image_std=HALF, do_convert_rgb=None,
                                     do_pan_and_scan=None, pan_and_scan_max_num_crops=None, image_seq_length=256,
                                     pan_and_scan_min_crop_size=None, pan_and_scan_min_ratio_to_activate=None),
                   model_processor="Gemma3Processor"),
    "gemma3_pas": spec("preprocessor", dict(image_processor_type="Gemma3ImageProcessor",
                                            size={"height": 24, "width": 24}), PAS, "Gemma3Processor"),
    # Pan and scan in the config only: Gemma3Processor's own do_pan_and_scan=False comes over it.
    "gemma3_config_pas": spec("preprocessor", dict(image_processor_type="Gemma3ImageProcessor",
                                                   size={"height": 24, "width": 24}, **PAS),
                              model_processor="Gemma3Processor"),
    "qwen2_vl": spec("preprocessor", dict(image_processor_type="Qwen2VLImageProcessor", min_pixels=3136,
                                          max_pixels=12544, patch_size=14, temporal_patch_size=2, merge_size=2,
                                          image_mean=CLIP_MEAN, image_std=CLIP_STD)),
    "qwen3_vl": spec("processor", dict(image_processor_type="Qwen2VLImageProcessorFast",
                                       size={"shortest_edge": 2048, "longest_edge": 16384}, patch_size=16,
                                       temporal_patch_size=2, merge_size=2, image_mean=HALF, image_std=HALF)),
    # A call-time pixel budget over the config's.
    "qwen3_vl_budget": spec("processor", dict(image_processor_type="Qwen2VLImageProcessor", patch_size=16,
                                              size={"shortest_edge": 2048, "longest_edge": 16384}),
                            dict(size={"shortest_edge": 1024, "longest_edge": 4096})),
    # Pixtral: the longest edge shrunk to 40, sides rounded up to whole 8-pixel patches.
    "pixtral": spec("preprocessor", dict(image_processor_type="PixtralImageProcessor",
                                         patch_size={"height": 8, "width": 8}, size={"longest_edge": 40})),
    # As Mistral 3 checkpoints save it: PixtralProcessor's patch_size (4) times its spatial_merge_size (2) over the
    # image processor's own patch_size (6), as the processor passes it.
    "pixtral_mistral3": spec("processor", dict(image_processor_type="PixtralImageProcessorFast", patch_size=6,
                                               size={"longest_edge": 36}, resample=2),
                             processor=dict(patch_size=4, spatial_merge_size=2),
                             ref_options=dict(patch_size={"height": 8, "width": 8})),
    # Gemma 4: resized to fill 70 soft tokens of 2x2 patches of 4 pixels (up or down), rescaled only; patches
    # [p, p, 3], padded to 280 by transformers (not by day0jax, which pads in the tower's call).
    "gemma4": spec("processor", dict(image_processor_type="Gemma4ImageProcessor", patch_size=4, max_soft_tokens=70,
                                     pooling_kernel_size=2)),
    # LFM2-VL (torchvision only): 4-pixel patches, between 4 and 16 tokens of 2x2 patches; the long images are split
    # into 16-pixel tiles and a thumbnail, the extreme one is not (its rounded size is small enough).
    "lfm2_vl": spec("preprocessor", dict(image_processor_type="Lfm2VlImageProcessor", encoder_patch_size=4,
                                         downsample_factor=2, min_image_tokens=4, max_image_tokens=16, tile_size=16,
                                         max_tiles=4, max_pixels_tolerance=4.0, do_convert_rgb=True),
                    backend="torchvision"),
    # Without splitting, the long images shrink to the token budget instead.
    "lfm2_vl_no_split": spec("preprocessor", dict(image_processor_type="Lfm2VlImageProcessor", encoder_patch_size=4,
                                                  min_image_tokens=4, max_image_tokens=16, do_image_splitting=False,
                                                  image_mean=CLIP_MEAN, image_std=CLIP_STD, do_convert_rgb=True),
                             backend="torchvision"),
    # Kimi K2.5 (torchvision only): shrunk to 64 patches of 4 pixels, 10 a side, padded to 8-pixel multiples.
    "kimi_k25": spec("preprocessor", dict(image_processor_type="Kimi_K25ImageProcessor", patch_size=4,
                                          merge_size=2, max_patches=64, size={"max_height": 10, "max_width": 10}),
                     backend="torchvision"),
    # A budget the small images fit (kept at their size, only padded), bilinear, rescaled without normalizing.
    "kimi_k25_pad": spec("processor", dict(image_processor_type="Kimi_K25ImageProcessor", patch_size=6,
                                           merge_size=2, max_patches=4096, size={"max_height": 60, "max_width": 60},
                                           resample=2, do_normalize=False), backend="torchvision"),
}
SIZES = {"odd": (37, 53), "wide": (23, 400), "tall": (400, 23), "tiny": (5, 7), "extreme": (2, 450)}  # (H, W)
# mode -> (the mode PIL opens the saved file in, whether it carries transparency)
MODES = {"RGB": ("RGB", False), "RGBA": ("RGBA", True), "L": ("L", False), "LA": ("LA", True), "P": ("P", False),
         "P_transparency": ("P", True), "RGB_transparency": ("RGB", True), "I;16": ("I;16", False),
         "1": ("1", False), "CMYK": ("CMYK", False)}
ENCODED = ["png_rgba", "jpeg", "webp_rgba", "webp", "gif", "gif_transparent", "jpeg_exif"]
OPAQUE = {"jpeg", "webp", "gif", "jpeg_exif"}  # where transformers' load_image (alpha dropped) sees the same pixels
KEY = (10, 200, 30)  # RGB_transparency's transparent colour
# torch's uint8 resize kernel against its numpy rendering: (size in, size out, mode, channels-last), shrinking by
# small and large factors, growing, one axis only, to and from a single pixel.
RESIZES = [((37, 53), (20, 31), "bicubic", False), ((37, 53), (20, 31), "bilinear", True),
           ((400, 23), (13, 5), "bicubic", True), ((23, 400), (40, 9), "bicubic", False),
           ((5, 7), (61, 44), "bicubic", False), ((5, 7), (61, 44), "bilinear", False),
           ((64, 48), (64, 17), "bicubic", False), ((64, 48), (3, 48), "bilinear", False),
           ((1, 9), (7, 1), "bicubic", False), ((300, 301), (299, 150), "bicubic", True)]


def pixels(h, w, channels, seed):
    """Smooth waves plus noise: resampling filters give visibly different results on it."""
    y, x = np.mgrid[0:h, 0:w]
    waves = np.stack([np.sin(x / (3 + c) + y / (5 + 2 * c)) * 100 + 128 for c in range(channels)], -1)
    noise = np.random.default_rng(seed).integers(-40, 41, (h, w, channels))
    return np.clip(waves + noise, 0, 255).astype(np.uint8)


def alpha(h, w, seed):
    """Fully transparent top third, opaque bottom third, every level in between."""
    a = np.random.default_rng(seed + 1).integers(0, 256, (h, w)).astype(np.uint8)
    a[: h // 3], a[h - h // 3:] = 0, 255
    return a


def save_mode_image(mode, h, w, seed, path):
    rgb = pixels(h, w, 3, seed)
    image, kwargs = Image.fromarray(rgb), {}
    if mode == "RGBA":
        image = Image.fromarray(np.dstack([rgb, alpha(h, w, seed)]))
    elif mode == "LA":
        image = Image.merge("LA", (image.convert("L"), Image.fromarray(alpha(h, w, seed))))
    elif mode in ("L", "1", "CMYK"):
        image = image.convert(mode)
    elif mode == "P":
        image = image.quantize(16)
    elif mode == "P_transparency":
        image, kwargs = image.quantize(16), {"transparency": 3}
    elif mode == "RGB_transparency":
        rgb[::3, ::2] = KEY
        image, kwargs = Image.fromarray(rgb), {"transparency": KEY}
    elif mode == "I;16":
        image = Image.fromarray(rgb[..., 0].astype(np.uint16) + rgb[..., 1] // 3)  # values past 255 clip in RGB
    image.save(path, "TIFF" if mode == "CMYK" else "PNG", **kwargs)


def encode(name, seed):
    h, w = SIZES["odd"]
    rgb, buf = pixels(h, w, 3, seed), io.BytesIO()
    rgba = np.dstack([rgb, alpha(h, w, seed)])
    if name == "png_rgba":
        Image.fromarray(rgba).save(buf, "PNG")
    elif name == "jpeg":
        Image.fromarray(rgb).save(buf, "JPEG", quality=90)
    elif name == "webp_rgba":
        Image.fromarray(rgba).save(buf, "WEBP", lossless=True)
    elif name == "webp":
        Image.fromarray(rgb).save(buf, "WEBP", quality=80)
    elif name == "gif":
        frames = [Image.fromarray(pixels(h, w, 3, seed + k)).quantize(32) for k in range(2)]
        frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    elif name == "gif_transparent":
        Image.fromarray(rgb).quantize(32).save(buf, "GIF", transparency=5)
    elif name == "jpeg_exif":
        exif = Image.Exif()
        exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to show upright
        Image.fromarray(rgb).save(buf, "JPEG", quality=90, exif=exif)
    return buf.getvalue()


def mode_path(root, size, mode):
    return root / f"{size}_{mode.replace(';', '')}.{'tif' if mode == 'CMYK' else 'png'}"


def data_url(data, kind="png"):
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The images, the processors' folders, and transformers' outputs: cases[name] lists (label, ours, ref index),
    `ours` a callable giving our input for that case."""
    root = tmp_path_factory.mktemp("vision_preprocess")
    images = []  # (label, our input as a zero-argument callable, reference image path, reference reads an array)
    files = []  # the labels of PIL images opened from files
    for seed, (size, (h, w)) in enumerate(SIZES.items()):
        for mode in MODES if size == "odd" else ["RGB", "RGBA"]:
            path = mode_path(root, size, mode)
            save_mode_image(mode, h, w, seed, path)
            images.append((f"{mode} {size}", lambda p=path: Image.open(p), path, False))
            files.append(f"{mode} {size}")
    h, w = SIZES["odd"]
    for name, ours in [("rgb", pixels(h, w, 3, 7)), ("gray", pixels(h, w, 1, 8)[..., 0]),
                       ("rgba", np.dstack([pixels(h, w, 3, 9), alpha(h, w, 9)]))]:
        path = root / f"array_{name}.npy"
        np.save(path, ours[..., None] if ours.ndim == 2 else ours)  # transformers takes no HxW array; HxWx1 it does
        images.append((f"array {name}", lambda a=ours: a, path, True))  # the processor reads the array itself
    for seed, name in enumerate(ENCODED):
        path = root / f"encoded_{name}"
        path.write_bytes(encode(name, 20 + seed))
        if name != "jpeg_exif":  # processors take the file as opened, without EXIF rotation
            images.append((f"data URL {name}", lambda p=path: load_image(data_url(p.read_bytes())), path, False))
    jobs, cases = {"pil": [], "torchvision": []}, {}
    for name, p in PROCESSORS.items():
        folder = root / name
        folder.mkdir()
        config = ({"processor_class": "P", **p["processor"], "image_processor": p["config"]}
                  if p["layout"] == "processor" else p["config"])
        (folder / f"{p['layout']}_config.json").write_text(json.dumps(config))
        cases[name] = []
        for label, ours, path, array in images:
            if p["files_only"] and label not in files:
                continue
            backend = jobs[p["backend"]]
            cases[name].append((label, ours, f"{p['backend']}_{len(backend)}"))
            backend.append({"processor": str(folder), "image": str(path), "array": array,
                            "kwargs": {**p["options"], **p["ref_options"]}, "model_processor": p["model_processor"]})
    resizes = []
    for i, (size_in, size_out, mode, channels_last) in enumerate(RESIZES):
        path = root / f"resize_{i}.npy"
        np.save(path, pixels(*size_in, 3, 40 + i).transpose(2, 0, 1).copy())
        resizes.append({"image": str(path), "size": list(size_out), "mode": mode, "channels_last": channels_last})
    run_reference([{"op": "image_processor_outputs", "cases": jobs["pil"], "out": str(root / "outputs.npz")},
                   {"op": "image_loads", "images": [str(root / f"encoded_{n}") for n in ENCODED],
                    "out": str(root / "loads.npz")}], root)
    run_reference([{"op": "image_processor_outputs", "cases": jobs["torchvision"], "torchvision": True,
                    "out": str(root / "outputs_torchvision.npz")},
                   {"op": "torch_resizes", "cases": resizes, "out": str(root / "resizes.npz")}], root)
    out = {f"pil_{k}": v for k, v in np.load(root / "outputs.npz").items()}
    out.update({f"torchvision_{k}": v for k, v in np.load(root / "outputs_torchvision.npz").items()})
    return {"root": root, "cases": cases, "out": out, "loads": dict(np.load(root / "loads.npz")),
            "resizes": dict(np.load(root / "resizes.npz"))}


def refused(name, label):
    """Whether transformers refuses the case: Qwen-VL's aspect ratio above 200, a resize to 0 pixels, or a colour
    mode other than RGB where RGB conversion is off."""
    if name == "siglip_no_rgb":
        return not label.startswith(("RGB ", "RGB_transparency "))
    return label.endswith("extreme") and (name.startswith(("qwen", "pixtral")) or name in ("clip_bounds", "clip_maxhw"))


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_processor_matches_transformers(name, ref):
    processor = image_processor(ref["root"] / name, **PROCESSORS[name]["options"])
    crops = 0
    for label, ours, (backend, i) in ((c[0], c[1], c[2].split("_")) for c in ref["cases"][name]):
        out = {k.removeprefix(f"{backend}_"): v for k, v in ref["out"].items() if k.startswith(f"{backend}_")}
        assert (f"error_{i}" in out) == refused(name, label), f"{name} {label}: {out.get(f'error_{i}')}"
        if refused(name, label):
            with pytest.raises(ImageError):
                processor.preprocess(ours())
            continue
        expected = out[f"pixel_values_{i}"]
        got = processor.preprocess(ours())
        if name.startswith("lfm2_vl"):  # [tiles (+ thumbnail), most patches, d], each padded: ours one after another
            shapes = out[f"spatial_shapes_{i}"].tolist()
            tiled = len(shapes) > 1
            assert tiled == (name == "lfm2_vl" and label.endswith(("wide", "tall"))), f"{name} {label}"
            grid = got.grid_thw
            want = [[grid[5]] * 2] * (grid[3] * grid[4]) + [list(grid[1:3])] if tiled else [list(grid[1:])]
            assert shapes == want, f"{name} {label}"
            sizes = [h * w for h, w in shapes]
            assert not any(e[n:].any() for e, n in zip(expected, sizes))
            expected = np.concatenate([e[:n] for e, n in zip(expected, sizes)])
        elif name == "gemma4":  # [1, 280, d] padded: ours the image's own patches, the rest zeros there
            n = len(got.pixel_values)
            assert not expected[0, n:].any() and n == int(out["num_soft_tokens_per_image_" + i]) * 4
            expected = expected[0, :n]
        elif name.startswith("pixtral"):  # the one image [1, 3, H, W]: ours as patches of the grid, raster order
            _, rows, cols = got.grid_thw
            p = expected.shape[2] // rows
            expected = expected[0].reshape(3, rows, p, cols, p).transpose(1, 3, 0, 2, 4).reshape(rows * cols, -1)
        elif got.grid_thw is not None and expected.ndim == 4:  # Kimi K2.5's patches as [3, p, p]: ours flattened
            expected = expected.reshape(len(expected), -1)
        values = got.pixel_values if got.grid_thw is not None or got.pixel_values.ndim == 4 else got.pixel_values[None]
        assert values.dtype == np.float32, f"{name} {label}"
        assert values.shape == expected.shape, f"{name} {label}"
        # Exact: the same resize of the same uint8 pixels (PIL's, or torch's kernel and its rendering), then the
        # same float steps.
        np.testing.assert_array_equal(values, expected, err_msg=f"{name} {label}")
        if f"grid_thw_{i}" in out or name.startswith(("pixtral", "lfm2_vl")) or name == "gemma4":
            if f"grid_thw_{i}" in out:
                assert got.grid_thw == tuple(out[f"grid_thw_{i}"].tolist()), f"{name} {label}"
            image = ours()
            size = image.shape[:2] if isinstance(image, np.ndarray) else image.size[::-1]
            assert processor.grid_thw(*size) == got.grid_thw, f"{name} {label}"
        else:
            assert got.grid_thw is None
        assert got.num_crops == int(out.get(f"num_crops_{i}", 0)), f"{name} {label}"
        crops += got.num_crops
    assert (crops > 0) == (name == "gemma3_pas")  # the long images get crops there, so their math is exercised


def test_torch_uint8_resize_rendered_exactly(ref):
    """`vision.resize` gives torch's own uint8 kernel's pixels, level for level; PIL's filter (the same bicubic)
    differs by a level on some of them, which is why the torchvision processors do not use it."""
    from day0jax.vision.resize import resize

    for i, (size_in, size_out, mode, _) in enumerate(RESIZES):
        x = pixels(*size_in, 3, 40 + i).transpose(2, 0, 1).copy()
        np.testing.assert_array_equal(resize(x, *size_out, mode), ref["resizes"][f"resized_{i}"], err_msg=str(i))
    x, (h, w) = pixels(37, 53, 3, 40), RESIZES[0][1]
    pil = np.array(Image.fromarray(x).resize((w, h), Image.BICUBIC)).transpose(2, 0, 1)
    assert 0 < np.abs(pil.astype(int) - ref["resizes"]["resized_0"]).max() <= 1


def test_colour_modes_are_what_they_claim(ref):
    """The saved test images open in the modes (and with the transparency) the cases are named after."""
    for mode, (opened, transparent) in MODES.items():
        image = Image.open(mode_path(ref["root"], "odd", mode))
        assert image.mode == opened, mode
        assert ("A" in image.getbands() or "transparency" in image.info) == transparent, mode


def test_load_image_converts_like_the_processors(ref):
    """Every mode loads into the RGB pixels the processors compute from it (alpha composited onto white)."""
    clip = image_processor(ref["root"] / "clip")
    for mode in MODES:
        image = Image.open(mode_path(ref["root"], "odd", mode))
        loaded = load_image(image)
        assert loaded.mode == "RGB" and loaded.size == image.size
        np.testing.assert_array_equal(clip.preprocess(loaded).pixel_values, clip.preprocess(image).pixel_values)
    keyed = np.array(load_image(Image.open(mode_path(ref["root"], "odd", "RGB_transparency"))))
    assert (keyed[::3, ::2] == 255).all()  # the transparent colour became white


def test_data_urls_decode_like_transformers(ref):
    loads = ref["loads"]
    for i, name in enumerate(ENCODED):
        data = (ref["root"] / f"encoded_{name}").read_bytes()
        ours = np.array(load_image(data_url(data, "webp" if "webp" in name else "png")))
        if name == "jpeg_exif":  # upright, as transformers' load_image turns it
            assert ours.shape[:2] == SIZES["odd"][::-1]
        else:
            np.testing.assert_array_equal(ours, loads[f"converted_{i}"], err_msg=name)
        if name in OPAQUE:
            np.testing.assert_array_equal(ours, loads[f"loaded_{i}"], err_msg=name)
        np.testing.assert_array_equal(np.array(load_image(data)), ours)  # the same bytes, given as bytes
    gif = (ref["root"] / "encoded_gif").read_bytes()
    frames = Image.open(io.BytesIO(gif))
    assert frames.n_frames == 2
    frames.seek(1)
    assert not np.array_equal(np.array(frames.convert("RGB")), np.array(load_image(data_url(gif))))  # the first


def test_file_urls_only_inside_the_allowed_folder(tmp_path):
    media, outside = tmp_path / "media", tmp_path / "outside"
    media.mkdir(), outside.mkdir()
    png = encode("png_rgba", 1)
    (media / "a cat.png").write_bytes(png)
    (outside / "secret.png").write_bytes(png)
    os.symlink(outside / "secret.png", media / "link.png")
    expected = np.array(load_image(png))
    url = (media / "a cat.png").as_uri()  # file:///.../a%20cat.png
    np.testing.assert_array_equal(np.array(load_image(url, allowed_media_dir=media)), expected)
    np.testing.assert_array_equal(np.array(load_image(f"file://localhost{media}/a%20cat.png",
                                                      allowed_media_dir=str(media))), expected)
    for source, message in [((outside / "secret.png").as_uri(), "outside the allowed media folder"),
                            (f"file://{media}/../outside/secret.png", "outside the allowed media folder"),
                            ((media / "link.png").as_uri(), "outside the allowed media folder"),
                            ((media / "missing.png").as_uri(), "no such file"),
                            (f"file://otherhost{media}/a%20cat.png", "local file"),
                            (f"file://{media}/a%20cat.png%00.txt", "control character"),
                            (f"file://{media}/a\x00cat.png", "control character")]:
        with pytest.raises(ImageError, match=message):
            load_image(source, allowed_media_dir=media)
    with pytest.raises(ImageError, match="no media folder is allowed"):
        load_image(url)


def test_a_link_swapped_in_after_the_check_is_not_followed(tmp_path, monkeypatch):
    """The folder check resolves links; a link put in the file's place between the check and the open (simulated by
    a check that returns the link's path) is refused, not read."""
    from day0jax.vision import images

    media, outside = tmp_path / "media", tmp_path / "outside"
    media.mkdir(), outside.mkdir()
    (outside / "secret.png").write_bytes(encode("png_rgba", 1))
    os.symlink(outside / "secret.png", media / "cat.png")
    monkeypatch.setattr(images, "allowed_path", lambda url, folder: str(media / "cat.png"))
    with pytest.raises(ImageError, match="cannot read the file"):
        load_image((media / "cat.png").as_uri(), allowed_media_dir=media)


def _png_header_only(width, height):
    """A PNG that claims width x height pixels and holds none: a decompression bomb's header."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("source, message", [
    ("data:image/png;base64,!!not*base64", "bad base64"),
    ("http://example.com/cat.png", "never fetches"),
    ("HTTPS://example.com/cat.png", "never fetches"),
    ("ftp://example.com/cat.png", "unsupported URL scheme 'ftp'"),
    ("/etc/passwd", "not an image URL"),
    ("data:text/plain;base64,aGVsbG8=", "data:image/"),
    ("data:image/png,%89PNG", "base64-encoded"),
    ("data:image/png;base64,", "no data"),
    (data_url(b"definitely not an image"), "cannot identify the image"),
    (data_url(encode("png_rgba", 0)[:60]), "cannot decode"),  # truncated
    (data_url(_png_header_only(8_000, 8_000)), "above the limit of 50000000"),  # refused before decoding
    (data_url(_png_header_only(100_000, 100_000)), "decompression bomb"),  # PIL's own check comes first here
    (np.zeros((4, 5, 3), np.float32), "must be uint8"),
    (np.zeros((4, 5, 2), np.uint8), "got shape"),
    (np.zeros((1, 4, 5, 3), np.uint8), "got shape"),
    (np.zeros((0, 5, 3), np.uint8), "empty image"),
    (12345, "unsupported image source of type int"),
], ids=lambda v: None if isinstance(v, str) and len(v) < 40 else "")
def test_load_image_errors(source, message):
    with pytest.raises(ImageError, match=message):
        load_image(source)


def test_unsupported_formats_and_size_limit():
    bmp = io.BytesIO()
    Image.fromarray(pixels(6, 7, 3, 0)).save(bmp, "BMP")
    with pytest.raises(ImageError, match="PNG, JPEG, WebP or GIF"):
        load_image(data_url(bmp.getvalue(), "bmp"))
    png = encode("png_rgba", 0)
    for source in (png, Image.open(io.BytesIO(png)), pixels(37, 53, 3, 0)):
        with pytest.raises(ImageError, match="37x53|53x37"):
            load_image(source, max_pixels=1000)
        assert load_image(source, max_pixels=37 * 53).size == (53, 37)
    assert issubclass(ImageError, ValueError)
    unpadded = data_url(png).rstrip("=")  # some encoders leave the padding out
    np.testing.assert_array_equal(np.array(load_image(unpadded[:40] + "\n" + unpadded[40:])),
                                  np.array(load_image(png)))


def test_processor_configs(tmp_path):
    with pytest.raises(UnsupportedArchitecture, match="Idefics3ImageProcessor"):
        image_processor({"image_processor_type": "Idefics3ImageProcessor"})
    with pytest.raises(ConfigError, match="no image processor config"):
        image_processor(tmp_path)
    with pytest.raises(ConfigError, match="names no image_processor_type"):
        image_processor({"size": 224})
    for bad in [{"size": {"longest_edge": 30}}, {"size": {"height": 30}}, {"size": "big"},
                {"resample": 9}, {"image_mean": [0.5, 0.5]}]:
        with pytest.raises(ConfigError):
            image_processor({"image_processor_type": "CLIPImageProcessorPil", **bad})
    with pytest.raises(ConfigError, match="rescale_factor"):  # a null is None, not the default
        image_processor({"image_processor_type": "CLIPImageProcessor", "rescale_factor": None})
    with pytest.raises(ConfigError, match="do_magic"):
        image_processor({"image_processor_type": "CLIPImageProcessor"}, do_magic=True)
    with pytest.raises(ConfigError, match="longest_edge"):
        image_processor({"image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": 10}})
    # processor_config.json's "image_processor" comes first; without it, preprocessor_config.json.
    (tmp_path / "preprocessor_config.json").write_text('{"image_processor_type": "SiglipImageProcessor"}')
    (tmp_path / "processor_config.json").write_text('{"processor_class": "X"}')
    assert type(image_processor(tmp_path)).__name__ == "SiglipImageProcessor"
    (tmp_path / "processor_config.json").write_text('{"image_processor": {"image_processor_type": '
                                                    '"Gemma3ImageProcessorFast", "size": {"height": 8, "width": 8}}}')
    gemma = image_processor(tmp_path)
    assert type(gemma).__name__ == "Gemma3ImageProcessor" and gemma.size == {"height": 8, "width": 8}
    (tmp_path / "processor_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        image_processor(tmp_path)
    no_rgb = image_processor({"image_processor_type": "SiglipImageProcessor", "do_convert_rgb": False})
    with pytest.raises(ImageError, match="do_convert_rgb"):
        no_rgb.preprocess(Image.new("RGBA", (4, 4)))
    assert no_rgb.preprocess(Image.new("RGB", (4, 4))).pixel_values.shape == (3, 224, 224)
