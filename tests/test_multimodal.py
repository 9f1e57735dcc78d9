"""Vision-language families against transformers at float32: image features, logits and greedy decoding with
images, through `Model.logits`, `Model.generate` (the engine) and `Model.prepare`.

Tolerance: max |ours - transformers| <= RTOL * max |transformers| (relative to the scale, as the text families).
Images go through day0jax's preprocessing on both sides (transformers gets the same pixel arrays), so these tests see
the model alone; tests/test_vision_preprocess.py compares the pixels. What images bring to the language model
(multimodal RoPE, DeepStack, Gemma 3's image spans), broken in day0jax alone, must move the logits by at least
MUTATION_FACTOR times RTOL (tests/mutations.py).
"""

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
from families import CLIP_TOWER, IMAGE_TOKEN, MULTIMODAL as VL_FAMILIES, TINY, image_tokens

# Worst observed 2.4e-6 (qwen3_5; the others 7e-7 to 1.3e-6), float32 on the CPU, with images.
RTOL = 1e-5
NEW_TOKENS = 16
MEASURED: dict[str, float] = {}  # family -> worst relative logits error with images; conftest prints it after the run

def images(seed: int, count: int) -> list[np.ndarray]:
    """`count` random uint8 RGB images of odd, differing sizes."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (int(rng.integers(20, 60)), int(rng.integers(20, 60)), 3), dtype=np.uint8)
            for _ in range(count)]


def placeholders(case, image) -> list[int]:
    before, after = case.around
    return before + [IMAGE_TOKEN] * image_tokens(case, image) + after


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
                data[f"grid_{i}"] = np.array([p.grid_thw for p in processed])
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


def day0jax_image(array):
    from day0jax.vision.images import load_image

    return load_image(array)


@pytest.fixture(scope="module", params=list(VL_FAMILIES))
def family(request, reference, tmp_path_factory):
    from convert import convert_checkpoint

    name = request.param
    dst = convert_checkpoint(reference[name]["hf"], tmp_path_factory.mktemp("vl-converted") / name,
                             progress=False).dst
    yield name, day0jax.load(dst, dtype="float32", kernels="strict"), dict(reference[name], dst=dst)
    jax.clear_caches()
    gc.collect()


def rel_err(ours, ref):
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


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
        assert err < RTOL, f"{name} case {i}: relative error {err:.2e}"
    # One batch of rows with other images (and one without) gives each row's logits.
    tokens = [t for t, _ in ref["cases"]]
    width = max(map(len, tokens))
    padded = [t + [0] * (width - len(t)) for t in tokens]
    batch = model.logits(padded, images=[imgs for _, imgs in ref["cases"]])
    for i, t in enumerate(tokens):
        assert rel_err(batch[i, :len(t)], ref["ref"][f"logits_{i}"]) < RTOL, f"{name} batched row {i}"


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
    the two-image case by at least MUTATION_FACTOR times RTOL; an unmutated copy in the same program still matches."""
    name, model, ref = family
    feature = feature[1]
    tokens, imgs = ref["cases"][mutations.VL_CASE]
    if name not in _MUTATED:
        _MUTATED.clear()
        _MUTATED[name] = mutations.mutated_logits(model, dict(mutations.VL_MUTATIONS[name]), tokens, imgs)
    out, theirs = _MUTATED[name], ref["ref"][f"logits_{mutations.VL_CASE}"]
    assert rel_err(out[None], theirs) < RTOL, "the unmutated copy does not reproduce the parity logits"
    if isinstance(out[feature], Exception):
        raise out[feature]
    assert np.isfinite(out[feature]).all()
    moved = rel_err(out[feature], theirs)
    assert moved >= mutations.MUTATION_FACTOR * RTOL, f"{name}: without {feature!r} the logits move by {moved:.2e}"


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
    """With prefill chunks of 8 tokens, the engine still prefills each image whole where its tokens attend to each
    other (Gemma 3: a chunk that would cut the second image ends before it), and the tokens match transformers."""
    from day0jax.engine.config import EngineConfig

    name, _, ref = family
    small = day0jax.load(ref["dst"], dtype="float32", engine=EngineConfig(chunk_buckets=(8,)), kernels="strict")
    prompts = [t for t, _ in ref["cases"]]
    outs = small.generate(prompts, NEW_TOKENS, ignore_eos=True, images=[imgs for _, imgs in ref["cases"]])
    for i, out in enumerate(outs):
        assert out == ref["ref"][f"generated_{i}"].tolist(), f"{name} case {i}"
    if small.vision.bidirectional:
        too_long = [1] + [IMAGE_TOKEN] * 12  # 12 image tokens in one run cannot fit a chunk of 8
        with pytest.raises(GenerationError, match="one chunk"):
            small.generate([too_long], 1, images=[images(0, 3)])


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
    shapes = [(20, 30), (57, 41), (40, 40)]
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
