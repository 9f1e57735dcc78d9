"""Vision-language families against transformers at float32: image features, logits and greedy decoding with
images, through `Model.logits`, `Model.generate` (the engine) and `Model.prepare`.

Tolerance: as the text families' (tests/parity.py): relative to the logit scale, tolerance(family) for logits.
Images go through day0jax's preprocessing on both sides (transformers gets the same pixel arrays), so these tests see
the model alone; tests/test_vision_preprocess.py compares the pixels. What images bring to the language model
(multimodal RoPE, DeepStack, Gemma 3's image spans), broken in day0jax alone, must move the logits by at least
MUTATION_FACTOR times that tolerance (tests/mutations.py).
"""

import dataclasses
import gc
import json
import re

import jax
import numpy as np
import pytest

import day0jax
import mutations
from conftest import run_reference
from day0jax.core.errors import GenerationError
from day0jax.layers.attention import ContextKV
from day0jax.models.gemma3 import visible_until as gemma3_visible_until
from parity import RTOL, rel_err, tolerance
from families import CLIP_TOWER, IMAGE_TOKEN, MULTIMODAL as VL_FAMILIES, TINY, image_placeholders, image_tokens, \
    parity_engine

# Logits with images are judged as the text families' (tests/parity.py): worst observed 1.09e-5 (gemma4, within its
# 3e-5), 2.4e-6 (qwen3_5; the others 5e-7 to 2.3e-6), float32 on the CPU. Image features: RTOL.
NEW_TOKENS = 16
MEASURED: dict[str, float] = {}  # family -> worst relative logits error with images; conftest prints it after the run

def images(seed: int, count: int) -> list[np.ndarray]:
    """`count` random uint8 RGB images of odd, differing sizes."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (int(rng.integers(20, 60)), int(rng.integers(20, 60)), 3), dtype=np.uint8)
            for _ in range(count)]


def placeholders(case, image) -> list[int]:
    before, after = case.around
    return before + image_placeholders(case, image, IMAGE_TOKEN) + after


def cases(case) -> list[tuple[list[int], list[np.ndarray]]]:
    """(token ids with expanded placeholders, images): one image after a short text, two images between texts,
    and text only."""
    one, two = images(0, 1), images(1, 2)
    return [([1, 17, 42] + placeholders(case, one[0]) + [5, 99, 7], one),
            ([1, 9] + placeholders(case, two[0]) + [33, 61, 2, 8] + placeholders(case, two[1]) + [120, 14], two),
            ([1, 17, 42, 5, 99, 3, 4], [])]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per family: the HF folder (with its preprocessor config), the cases, and transformers' outputs."""
    from day0jax.vision.processors import image_processor

    root = tmp_path_factory.mktemp("vl")
    jobs, out = [], {}
    for name, case in VL_FAMILIES.items():
        proc = image_processor(case.processor)
        data = {}
        for i, (tokens, imgs) in enumerate(cases(case)):
            data[f"tokens_{i}"] = np.asarray(tokens, np.int32)
            processed = [proc.preprocess(day0jax_image(im)) for im in imgs]
            if processed and processed[0].grid_thw is None:
                data[f"pixels_{i}"] = np.stack([p.pixel_values for p in processed])
            elif processed:  # images of their own size: their patches one after another, and their grids
                data[f"pixels_{i}"] = np.concatenate([p.pixel_values for p in processed])
                data[f"grid_{i}"] = grid_array([p.grid_thw for p in processed])
        np.savez(root / f"{name}.inputs.npz", **data)
        jobs.append({"op": "tiny_hf", "family": case.model_type, "config": case.config, "seed": 0,
                     "out": str(root / name), "multimodal": True})
        jobs.append({"op": "vl_run", "model": str(root / name), "inputs": str(root / f"{name}.inputs.npz"),
                     "generate": NEW_TOKENS, "out": str(root / f"{name}.npz")})
        out[name] = dict(hf=root / name, cases=cases(case))
    run_reference(jobs, root)
    for name, case in VL_FAMILIES.items():
        (root / name / "preprocessor_config.json").write_text(json.dumps(case.processor))
        out[name]["ref"] = np.load(root / f"{name}.npz")
    return out


def grid_array(grids) -> np.ndarray:
    """Images' grids as one int array, zero-padded to the longest (LFM2-VL's tiled images have 6 entries)."""
    width = max(map(len, grids))
    return np.array([tuple(g) + (0,) * (width - len(g)) for g in grids])


def day0jax_image(array):
    from day0jax.vision.images import load_image

    return load_image(array)


@pytest.fixture(scope="module", params=list(VL_FAMILIES))
def family(request, reference, tmp_path_factory):
    from convert import convert_checkpoint

    name = request.param
    dst = convert_checkpoint(reference[name]["hf"], tmp_path_factory.mktemp("vl-converted") / name,
                             progress=False).dst
    model = day0jax.load(dst, dtype="float32", kernels="strict", engine=parity_engine())
    yield name, model, dict(reference[name], dst=dst)
    jax.clear_caches()
    gc.collect()


def test_image_features_match_transformers(family):
    name, model, ref = family
    for i, (_, imgs) in enumerate(ref["cases"]):
        if imgs:
            ours = model.images.features(imgs)
            assert ours.shape == ref["ref"][f"features_{i}"].shape
            assert rel_err(ours, ref["ref"][f"features_{i}"]) < RTOL, f"{name} case {i}"


def test_logits_with_images_match_transformers(family):
    name, model, ref = family
    for i, (tokens, imgs) in enumerate(ref["cases"]):
        ours = model.logits([tokens], images=[imgs])[0]
        err = rel_err(ours, ref["ref"][f"logits_{i}"])
        MEASURED[name] = max(MEASURED.get(name, 0.0), err)
        assert err < tolerance(name), f"{name} case {i}: relative error {err:.2e}"
    # One batch of rows with other images (and one without) gives each row's logits.
    tokens = [t for t, _ in ref["cases"]]
    width = max(map(len, tokens))
    padded = [t + [0] * (width - len(t)) for t in tokens]
    batch = model.logits(padded, images=[imgs for _, imgs in ref["cases"]])
    for i, t in enumerate(tokens):
        assert rel_err(batch[i, :len(t)], ref["ref"][f"logits_{i}"]) < tolerance(name), f"{name} batched row {i}"


# Each feature param is (family, feature): its value names one test alone, so that pytest, which groups the tests of
# module-scoped params by value, keeps each family's tests together.
VL_FEATURES = [pytest.param(name, (name, feature), id=mutations.feature_id(name, feature))
               for name, features in mutations.VL_MUTATIONS.items() for feature, _ in features]
_MUTATED: dict[str, dict] = {}  # family -> feature (None: unmutated) -> logits or the exception


def test_every_family_lists_what_images_bring():
    assert set(mutations.VL_MUTATIONS) == set(VL_FAMILIES)


@pytest.mark.parametrize("family, feature", VL_FEATURES, indirect=["family"], scope="module")
def test_image_feature_moves_logits(family, feature):
    """What images bring to the language model, broken in day0jax alone (tests/mutations.py), moves the logits of
    the two-image case by at least MUTATION_FACTOR times the tolerance; an unmutated copy in the same program still matches."""
    name, model, ref = family
    feature = feature[1]
    tokens, imgs = ref["cases"][mutations.VL_CASE]
    if name not in _MUTATED:
        _MUTATED.clear()
        _MUTATED[name] = mutations.mutated_logits(model, dict(mutations.VL_MUTATIONS[name]), tokens, imgs)
    out, theirs = _MUTATED[name], ref["ref"][f"logits_{mutations.VL_CASE}"]
    assert rel_err(out[None], theirs) < tolerance(name), "the unmutated copy does not reproduce the parity logits"
    if isinstance(out[feature], Exception):
        raise out[feature]
    assert np.isfinite(out[feature]).all()
    moved = rel_err(out[feature], theirs)
    assert moved >= mutations.MUTATION_FACTOR * tolerance(name), f"{name}: without {feature!r} the logits move by {moved:.2e}"


def test_greedy_decode_with_images_matches_transformers(family):
    name, model, ref = family
    prompts = [t for t, _ in ref["cases"]]
    outs = model.generate(prompts, NEW_TOKENS, ignore_eos=True, images=[imgs for _, imgs in ref["cases"]])
    for i, out in enumerate(outs):
        assert out == ref["ref"][f"generated_{i}"].tolist(), f"{name} case {i}"


def test_prefix_cache_keeps_images_apart(family):
    """Equal tokens over other images share no cached pages: after a prompt over image A fills the prefix cache,
    the same prompt over image B reads none of its pages (and gives B's token), the prompt over A again reads them."""
    name, model, ref = family
    a, b = images(0, 1), images(1, 1)
    per_image = image_tokens(VL_FAMILIES[name], a[0])
    if image_tokens(VL_FAMILIES[name], b[0]) != per_image:  # images of their own size: B the size of A
        b = [np.random.default_rng(1).integers(0, 256, a[0].shape, dtype=np.uint8)]
    # The image ends the first 16-token page (the engine's default page size), which the prefix cache then holds.
    text = max(1, 16 - per_image)
    tokens = [1] + [5 + i for i in range(text - 1)] + [IMAGE_TOKEN] * per_image + [40]
    scheduler = model.engine.scheduler

    def first_token(imgs):  # through the engine, and the number of prompt tokens it read from the prefix cache
        hits = scheduler.prefix_hit_tokens
        out = model.generate([tokens], 1, ignore_eos=True, images=[imgs])[0]
        assert out == [int(model.logits([tokens], images=[imgs])[0, -1].argmax())]  # as without a cache
        return scheduler.prefix_hit_tokens - hits

    first_token(a)
    assert first_token(b) == 0
    # Models with linear attention keep a state per sequence that cached pages cannot restore: no prefix cache.
    assert first_token(a) >= (16 if model.engine.config.prefix_caching else 0)


def test_placeholder_and_image_counts_must_match(family):
    name, model, ref = family
    tokens, imgs = ref["cases"][1]
    with pytest.raises(GenerationError, match="placeholder"):
        model.logits([tokens], images=[imgs[:1]])
    with pytest.raises(GenerationError, match="placeholder"):
        model.generate([tokens[:-6]], 2, images=[imgs])


def test_image_tokens_attend_both_ways_across_small_chunks(family):
    """With prefill chunks of 8 tokens (or the fewest multiple of 8 that holds an image of the family whose tokens
    attend both ways: Gemma 4's hold 60 and more), the engine still prefills each image whole where its tokens attend
    to each other (a chunk that would cut the second image ends before it), and the tokens match transformers."""
    name, model, ref = family
    run = max(image_tokens(VL_FAMILIES[name], im) for _, imgs in ref["cases"] for im in imgs)
    chunk = 8 if not model.vision.bidirectional else -(-run // 8) * 8
    engine = dataclasses.replace(parity_engine(), chunk_buckets=(chunk,))
    small = day0jax.load(ref["dst"], dtype="float32", engine=engine, kernels="strict")
    prompts = [t for t, _ in ref["cases"]]
    outs = small.generate(prompts, NEW_TOKENS, ignore_eos=True, images=[imgs for _, imgs in ref["cases"]])
    for i, out in enumerate(outs):
        assert out == ref["ref"][f"generated_{i}"].tolist(), f"{name} case {i}"
    if small.vision.bidirectional:  # adjacent images: one run of image tokens longer than a chunk
        count = next(n for n in range(1, 10) if sum(image_tokens(VL_FAMILIES[name], im)
                                                    for im in images(0, n)) > chunk)
        too_long = [1] + [IMAGE_TOKEN] * sum(image_tokens(VL_FAMILIES[name], im) for im in images(0, count))
        with pytest.raises(GenerationError, match="one chunk"):
            small.generate([too_long], 1, images=[images(0, count)])


def test_current_key_layout_converts_to_the_same_model(reference, tmp_path):
    """transformers' current names (`model.language_model.`, `model.vision_tower.vision_model.`, `lm_head.`) and the
    layout transformers 5 saves give the same checkpoint."""
    from safetensors.numpy import load_file, save_file

    from convert import convert_checkpoint
    from day0jax.models.vision_language import LEGACY_NAMES
    from day0jax.weights import checkpoint

    src = reference["llava"]["hf"]
    renamed = tmp_path / "current"
    renamed.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (renamed / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    current = {}
    for name, array in tensors.items():
        new = next((re.sub(p, r, name) for p, r in LEGACY_NAMES if re.search(p, name)), name)
        current[new] = array
    assert any(n.startswith("model.vision_tower.vision_model.") for n in current)
    save_file(current, str(renamed / "model.safetensors"))
    a = convert_checkpoint(src, tmp_path / "a", progress=False).dst
    b = convert_checkpoint(renamed, tmp_path / "b", progress=False).dst
    pa, pb = checkpoint.read_manifest(a)["params"], checkpoint.read_manifest(b)["params"]
    assert pa == pb
    assert (b / "preprocessor_config.json").is_file()  # the processor travels with the checkpoint


def test_check_reports_the_vision_side(reference):
    from day0jax.check import check, render

    report = check(reference["gemma3"]["hf"])
    assert report.supported, report.reasons
    assert report.vision["tokens_per_image"] == 4 and report.vision["image_tokens_attend_both_ways"]
    assert report.vision["parameters"] > 0
    assert any(op["op"] == "vision_attention" and op["layers"] == "vision" for op in report.ops)
    keys = {row["key"]: row["status"] for row in report.keys}
    assert keys["vision_config.patch_size"] == "used" and keys["text_config.sliding_window"] == "used"
    assert "tokens per image" in render(report)


@pytest.mark.parametrize("change, words", [
    (dict(vision_feature_select_strategy="cls"), ["vision_feature_select_strategy", "'cls'"]),
    (dict(vision_feature_layer=-9), ["vision_feature_layer", "does not have"]),
    (dict(vision_config=dict(CLIP_TOWER, model_type="pixtral")), ["pixtral", "vision tower"]),
    (dict(vision_config=dict(CLIP_TOWER, use_rope=True)), ["use_rope"]),
    (dict(text_config=dict(TINY, model_type="not_a_family")), ["not_a_family"]),
])
def test_unsupported_vision_options_are_refused_by_name(reference, tmp_path, change, words):
    """`check` says why before any weight is read, and `convert` refuses the same folder without writing."""
    from convert import convert_checkpoint
    from day0jax.check import check
    from day0jax.core.errors import Day0Error

    src = tmp_path / "src"
    src.mkdir()
    hf = json.loads((reference["llava"]["hf"] / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(hf, **change)))
    (src / "model.safetensors").write_bytes((reference["llava"]["hf"] / "model.safetensors").read_bytes())
    report = check(src)
    assert not report.supported
    assert all(w in " ".join(report.reasons) for w in words), report.reasons
    with pytest.raises(Day0Error) as e:
        convert_checkpoint(src, tmp_path / "dst", progress=False)
    assert all(w in str(e.value) for w in words), e.value
    assert not (tmp_path / "dst").exists()



@pytest.mark.parametrize("family", ["gemma3"], indirect=True)  # one family suffices for the tool
def test_verify_compares_pixels_tower_features_and_layers(family):
    """`day0jax.verify` on a vision-language checkpoint: pixels, each tower layer, the features, then the language
    model, all within tolerance; a perturbed tower layer shows at that row."""
    from day0jax.verify import compare_vision, verify

    _, _, ref = family
    result = verify(ref["dst"], ref["hf"])
    assert result.passed, result.failures
    names = [row.name for row in result.vision]
    assert names[0].startswith("pixels") and names[-1].startswith("image features") and "vision layer 2" in names
    assert all(row.max_rel < 1e-5 for row in result.vision)
    ours = {"pixels_0": np.ones((1, 3, 4, 4)), "vision_0": np.ones((3, 1, 4, 8)), "features_0": np.ones((4, 8))}
    theirs = {k: v.copy() for k, v in ours.items()}
    theirs["vision_0"][2] *= 1.5
    rows = compare_vision(ours, theirs, 1)
    assert [r.name for r in rows if r.max_rel > 0] == ["vision layer 2"]


class _Tokens:
    """A tokenizer's `decode` of single special tokens, enough for the placeholder expansion."""

    def __init__(self, names: dict[int, str]):
        self.names = names

    def decode(self, ids):
        return "".join(self.names[i] for i in ids)


def test_placeholders_expand_as_each_family_processor_does():
    """Gemma3Processor wraps each image in blank lines and begin/end tokens; Qwen3VLProcessor repeats each image's
    pad token as often as that image has merged patches; LLaVA repeats its image token; a template showing another
    number of images than given is refused."""
    from day0jax import models

    names = {IMAGE_TOKEN: "<img>", 248: "<boi>", 249: "<eoi>"}
    built = {n: models.abstract_model(models.config_from_hf(dict(c.config, model_type=c.model_type)))
             for n, c in VL_FAMILIES.items() if n in ("gemma3", "qwen3_vl", "llava")}
    tok = _Tokens(names)
    assert built["gemma3"].expand_image_placeholders("a<boi>b", [4], tok) == "a\n\n<boi>" + "<img>" * 4 + "<eoi>\n\nb"
    assert built["qwen3_vl"].expand_image_placeholders("<boi><img><eoi>x<boi><img><eoi>", [2, 3], tok) == \
        "<boi><img><img><eoi>x<boi><img><img><img><eoi>"
    assert built["llava"].expand_image_placeholders("<img>\nhi", [4], tok) == "<img>" * 4 + "\nhi"
    with pytest.raises(GenerationError, match="rendered 1 image placeholder"):
        built["qwen3_vl"].expand_image_placeholders("<img>", [2, 3], tok)
    # PixtralProcessor: each image's rows of [IMG], ended by [IMG_BREAK], the last by [IMG_END].
    mistral3 = models.abstract_model(models.config_from_hf(dict(VL_FAMILIES["mistral3"].config,
                                                                model_type="mistral3")))
    pixtral_tok = _Tokens({IMAGE_TOKEN: "[IMG]"})
    assert mistral3.expand_image_placeholders("a[IMG]b[IMG]", [6, 1], pixtral_tok, grids=[(1, 2, 3), (1, 1, 1)]) == \
        "a" + "[IMG]" * 3 + "[IMG_BREAK]" + "[IMG]" * 3 + "[IMG_END]b[IMG][IMG_END]"


def test_warm_up_makes_the_tower_ready_for_every_image_size(family):
    """The server's ready set holds the tower's programs (one, or one per patch-count bucket for images of their own
    size); once they are installed, images of several sizes encode without tracing anything."""
    from day0jax.engine.programs import Program
    from day0jax.startup.warmup import compile_programs

    name, model, ref = family
    runner = model.engine.runner
    encode = runner.catalog.encode()
    assert encode and set(encode) <= set(runner.catalog.ready()) and set(encode) <= set(runner.catalog.all())
    compile_programs(runner, [p for p in encode if not runner.installed(p)])
    traced = set(runner.compiled)
    shapes = [(20, 30), (57, 41), (40, 40), (300, 451), (23, 400)]  # the last two shrink to the processor's limits
    rng = np.random.default_rng(5)
    pictures = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]
    case = VL_FAMILIES[name]
    prompts = [[1, 2] + placeholders(case, p) + [3] for p in pictures]
    needed = set()
    for p in pictures:
        inputs = model.images.inputs([p])
        needed |= {key for key, _, _ in model.vision.encoder_calls(inputs.pixels, inputs.grids)}
    assert {Program("encode", key) for key in needed} <= set(encode)  # every size within a warmed-up bucket
    assert model.generate(prompts, 2, ignore_eos=True, images=[[p] for p in pictures])
    assert not [k for k in runner.compiled - traced if k[0] == "encode"], runner.compiled - traced


@pytest.mark.parametrize("family", ["kimi_k25"], indirect=True)
@pytest.mark.parametrize("broken", ["no_rotary", "rotary_axes_swapped", "nearest_position_table", "raster_merge"])
def test_moonvit_grid_dependence_is_checked(family, monkeypatch, broken):
    """MoonViT's grid-dependent pieces, each done wrong on the host, move the features far past the tolerance: the
    2-D rotary (off, or rows and columns exchanged), the bicubic resampling of the position table (nearest row
    instead), and the patch merger's 2x2 blocks (four consecutive patches instead)."""
    from day0jax.vision import moonvit

    name, model, ref = family
    original = moonvit.grid_inputs

    def grid_inputs(grid, side, merge):
        d = dict(original(grid, side, merge))
        if broken == "no_rotary":
            d["rotary"] = np.zeros_like(d["rotary"])
        elif broken == "rotary_axes_swapped":
            d["rotary"] = np.ascontiguousarray(d["rotary"][:, ::-1])
        elif broken == "nearest_position_table":
            nearest = np.take_along_axis(d["taps"], d["weights"].argmax(-1)[:, None], -1)
            d["taps"], d["weights"] = np.repeat(nearest, 16, -1), np.full_like(d["weights"], 1 / 16)
        else:
            d["merged"] = np.arange(len(d["merged"]), dtype=np.int32)
        return d
    monkeypatch.setattr(moonvit, "grid_inputs", grid_inputs)
    for i, (_, imgs) in enumerate(ref["cases"]):
        if imgs:
            assert rel_err(model.images.features(imgs), ref["ref"][f"features_{i}"]) > 1e-2, (broken, i)


@pytest.mark.parametrize("family", ["mistral3"], indirect=True)
@pytest.mark.parametrize("broken", ["no_rotary", "rotary_axes_swapped", "raster_merge"])
def test_pixtral_grid_dependence_is_checked(family, monkeypatch, broken):
    """Pixtral's 2-D rotary (off, or rows and columns exchanged) and Mistral 3's patch merger (four consecutive
    patches instead of 2x2 blocks), each done wrong on the host, move the features far past the tolerance."""
    from day0jax.vision import pixtral

    name, model, ref = family
    original = pixtral.grid_inputs

    def grid_inputs(rows, cols, merge):
        positions, blocks = original(rows, cols, merge)
        if broken == "no_rotary":
            return np.zeros_like(positions), blocks
        if broken == "rotary_axes_swapped":
            return np.ascontiguousarray(positions[:, ::-1]), blocks
        return positions, np.arange(blocks.size, dtype=np.int32).reshape(blocks.shape)
    monkeypatch.setattr(pixtral, "grid_inputs", grid_inputs)
    for i, (_, imgs) in enumerate(ref["cases"]):
        if imgs:
            assert rel_err(model.images.features(imgs), ref["ref"][f"features_{i}"]) > 1e-2, (broken, i)


@pytest.mark.parametrize("family", ["gemma4"], indirect=True)
@pytest.mark.parametrize("broken", ["no_rotary", "rotary_axes_swapped", "raster_pooling", "causal_images",
                                    "bidirectional_everywhere"])
def test_gemma4_vision_features_are_checked(family, monkeypatch, broken):
    """Gemma 4's 2-D rotary (off, or columns and rows exchanged) and its 2x2 pooling (four consecutive patches
    instead) move the features far past the tolerance; an image's tokens attending causally, or both ways in the
    global layers too (Gemma 3's rule), move the logits."""
    from day0jax.models import gemma4_vl
    from day0jax.vision import gemma4_vit

    name, model, ref = family
    if broken in ("causal_images", "bidirectional_everywhere"):
        original = gemma4_vl.Model._inputs

        def inputs(self, tokens, positions, caches, image_mask):  # the cache-less forward's (`logits`)
            text, layer_caches = original(self, tokens, positions, caches, image_mask)
            if caches is not None or layer_caches is None:
                return text, layer_caches
            if broken == "causal_images":
                return text, None
            return text, [ContextKV(visible_until=gemma3_visible_until(positions, image_mask)) for _ in layer_caches]
        monkeypatch.setattr(gemma4_vl.Model, "_inputs", inputs)
        jax.clear_caches()
        try:
            tokens, imgs = ref["cases"][0]
            assert rel_err(model.logits([tokens], images=[imgs])[0], ref["ref"]["logits_0"]) > 1e-3, broken
        finally:
            monkeypatch.undo()
            jax.clear_caches()
        return
    original_grid = gemma4_vit.grid_inputs

    def grid_inputs(rows, cols, k):
        positions, pooled = original_grid(rows, cols, k)
        if broken == "no_rotary":
            return np.zeros_like(positions), pooled
        if broken == "rotary_axes_swapped":
            return np.ascontiguousarray(positions[:, ::-1]), pooled
        return positions, (np.arange(len(pooled)) // (k * k)).astype(np.int32)
    monkeypatch.setattr(gemma4_vit, "grid_inputs", grid_inputs)
    for i, (_, imgs) in enumerate(ref["cases"]):
        if imgs:
            assert rel_err(model.images.features(imgs), ref["ref"][f"features_{i}"]) > 1e-2, (broken, i)


def test_kimi_k25_published_layout_converts_to_the_same_model(reference, tmp_path):
    """The published checkpoint's own tensor names (`language_model.model.layers.`, `vision_tower.patch_embed.`,
    `mm_projector.pre_norm.`) and its config keys (`vt_*`, `init_pos_emb_*`, `media_placeholder_token_id`) give the
    checkpoint transformers' saved layout gives."""
    from safetensors.numpy import load_file, save_file

    from convert import convert_checkpoint
    from day0jax.weights import checkpoint

    src = reference["kimi_k25"]["hf"]
    published = tmp_path / "published"
    published.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (published / f.name).write_bytes(f.read_bytes())
    names = {r"^language_model\.model\.blocks\.": "language_model.model.layers.",
             r"^vision_tower\.encoder\.patch_embed\.": "vision_tower.patch_embed.",
             r"^model\.mm_projector\.": "mm_projector."}
    tensors = {}
    for name, array in load_file(str(src / "model.safetensors")).items():
        for pattern, replacement in names.items():
            name = re.sub(pattern, replacement, name)
        tensors[name] = array
    assert "vision_tower.patch_embed.proj.weight" in tensors and "mm_projector.pre_norm.weight" in tensors
    save_file(tensors, str(published / "model.safetensors"))
    hf = json.loads((src / "config.json").read_text())
    v = hf.pop("vision_config")
    hf["media_placeholder_token_id"] = hf.pop("image_token_id")
    hf["vision_config"] = dict(
        model_type="", patch_size=v["patch_size"], init_pos_emb_height=v["pos_emb_height"],
        init_pos_emb_width=v["pos_emb_width"], init_pos_emb_time=v["pos_emb_time"],
        vt_hidden_size=v["hidden_size"], vt_intermediate_size=v["intermediate_size"],
        vt_num_attention_heads=v["num_attention_heads"], vt_num_hidden_layers=v["num_hidden_layers"],
        merge_kernel_size=v["merge_kernel_size"], merge_type="sd2_tpool", pos_emb_type="divided_fixed",
        video_attn_type="spatial_temporal", mm_projector_type="patchmerger", projector_hidden_act="gelu",
        projector_ln_eps=1e-5, mm_hidden_size=v["hidden_size"], text_hidden_size=hf["text_config"]["hidden_size"])
    hf.update(ignore_index=-100, use_unified_vision_chunk=True, video_placeholder="<|kimi_k25_video_placeholder|>")
    (published / "config.json").write_text(json.dumps(hf))
    a = convert_checkpoint(src, tmp_path / "a", progress=False).dst
    b = convert_checkpoint(published, tmp_path / "b", progress=False).dst
    pa, pb = checkpoint.read_params(a), checkpoint.read_params(b)
    assert sorted(pa) == sorted(pb)
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    bad = dict(hf, vision_config=dict(hf["vision_config"], merge_type="sd2"))
    (published / "config.json").write_text(json.dumps(bad))
    with pytest.raises(Exception, match="merge_type"):
        convert_checkpoint(published, tmp_path / "c", progress=False)


def test_qwen3_vl_moe_released_expert_layout_converts_to_the_same_model(reference, tmp_path):
    """Released Qwen3-VL-MoE checkpoints store the fused experts as [E, D, 2F] and [E, F, D], transformers 5 saves
    them transposed: both give the same checkpoint."""
    from safetensors.numpy import load_file, save_file

    from convert import convert_checkpoint
    from day0jax.weights import checkpoint

    src = reference["qwen3_vl_moe"]["hf"]
    released = tmp_path / "released"
    released.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (released / f.name).write_bytes(f.read_bytes())
    tensors = {name: np.ascontiguousarray(a.swapaxes(1, 2)) if ".experts." in name else a
               for name, a in load_file(str(src / "model.safetensors")).items()}
    assert tensors["model.language_model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 64, 96)
    save_file(tensors, str(released / "model.safetensors"))
    a = convert_checkpoint(src, tmp_path / "a", progress=False).dst
    b = convert_checkpoint(released, tmp_path / "b", progress=False).dst
    pa, pb = checkpoint.read_params(a), checkpoint.read_params(b)
    assert sorted(pa) == sorted(pb)
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


@pytest.mark.parametrize("family", ["kimi_k25"], indirect=True)
def test_an_image_sent_again_runs_no_tower_call(family):
    """One tower call per distinct image: the same pixels again (in another request, or twice in one) come from the
    runner's feature cache with the same features; other pixels run the tower; a cache of 0 bytes keeps nothing."""
    from day0jax.vision.spec import FeatureCache

    name, model, ref = family
    cache = model.runner.feature_cache
    a, b = images(7, 2)
    first = model.images.features([a])
    hits, misses = cache.hits, cache.misses
    again = model.images.features([b, a, a])
    assert (cache.hits - hits, cache.misses - misses) == (2, 1)
    np.testing.assert_array_equal(again[-2 * len(first):], np.concatenate([first, first]))
    tokens = [1, 2] + placeholders(VL_FAMILIES[name], a) + [3]
    hits = cache.hits
    assert model.generate([tokens], 2, ignore_eos=True, images=[[a]]) == \
        model.generate([tokens], 2, ignore_eos=True, images=[[a]])
    assert cache.hits - hits == 2
    empty = FeatureCache(0)
    empty.put(b"k", np.zeros((4, 4), np.float32), None)
    assert len(empty) == 0 and empty.get(b"k") is None
    small = FeatureCache(3 * 64)  # room for three [4, 4] float32 entries: the least recently used goes
    for k in (b"1", b"2", b"3"):
        small.put(k, np.zeros((4, 4), np.float32), None)
    small.get(b"1")
    small.put(b"4", np.zeros((4, 4), np.float32), None)
    assert small.get(b"2") is None and small.get(b"1") is not None and len(small) == 3


def test_gemma4_audio_tower_is_dropped_by_name_and_images_still_match(reference, tmp_path, caplog):
    """A Gemma 4 checkpoint with its audio tower: the audio tensors are dropped with a log line saying audio is not
    implemented, and the images' logits still match transformers' (run with the audio tower present)."""
    import logging

    from convert import convert_checkpoint

    case = VL_FAMILIES["gemma4"]
    audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=32,
                 subsampling_conv_channels=[8, 4])
    hf, inputs = tmp_path / "hf", reference["gemma4"]["hf"].parent / "gemma4.inputs.npz"
    run_reference([{"op": "tiny_hf", "family": "gemma4", "config": dict(case.config, audio_config=audio), "seed": 0,
                    "out": str(hf), "multimodal": True},
                   {"op": "vl_run", "model": str(hf), "inputs": str(inputs), "generate": 0,
                    "out": str(tmp_path / "ref.npz")}], tmp_path)
    (hf / "preprocessor_config.json").write_text(json.dumps(case.processor))
    with caplog.at_level(logging.INFO, logger="convert"):
        dst = convert_checkpoint(hf, tmp_path / "d0", progress=False).dst
    assert "audio_tower" in caplog.text and "audio input is not implemented" in caplog.text
    model = day0jax.load(dst, dtype="float32")
    tokens, imgs = reference["gemma4"]["cases"][0]
    err = rel_err(model.logits([tokens], images=[imgs])[0], np.load(tmp_path / "ref.npz")["logits_0"])
    assert err < RTOL, f"relative error {err:.2e}"


@pytest.mark.parametrize("family", ["lfm2_vl"], indirect=True)
@pytest.mark.parametrize("broken", ["positions_not_resized", "blocks_in_patch_order", "padding_attended"])
def test_lfm2_vl_vision_features_are_checked(family, monkeypatch, broken):
    """SigLIP2's position table resized to each grid (taken as its top-left corner instead), the pixel unshuffle's
    2x2 blocks (four consecutive patches instead) and the mask on padding patches (attended instead) each move the
    features far past the tolerance. The cases hold an image split into tiles and a thumbnail, and one that is not."""
    from day0jax.vision import siglip2

    name, model, ref = family
    grids = [model.images.inputs(imgs).grids for _, imgs in ref["cases"] if imgs]
    assert {len(g) for gs in grids for g in gs} == {3, 6}
    if broken == "positions_not_resized":
        def weights(rows, cols, side):
            r, c = np.divmod(np.arange(rows * cols), cols)
            return np.eye(side * side, dtype=np.float32)[(r % side) * side + c % side]
        monkeypatch.setattr(siglip2, "position_weights", weights)
    elif broken == "blocks_in_patch_order":
        monkeypatch.setattr(siglip2, "merge_blocks", lambda rows, cols, m, size: np.minimum(
            np.arange(size * m * m), rows * cols - 1).reshape(size, m * m).astype(np.int32))
    else:
        inputs = siglip2.Patches.inputs

        def attended(self, patches, grid):
            key, arrays, tokens = inputs(self, patches, grid)
            return key, (arrays[0], arrays[1], np.ones_like(arrays[2]), arrays[3]), tokens
        monkeypatch.setattr(siglip2.Patches, "inputs", attended)
    for i, (_, imgs) in enumerate(ref["cases"]):
        if imgs:
            assert rel_err(model.images.features(imgs), ref["ref"][f"features_{i}"]) > 1e-2, (broken, i)
