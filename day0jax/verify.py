"""`python -m day0jax.verify CKPT --reference HF_FOLDER`: layer-by-layer precision against transformers.

Runs the checkpoint and transformers (in its own Python, `--reference-python`: the runtime never imports torch) on
the same token ids and prints, per hidden state (embeddings, each layer's output, the last after the final norm),
max |ours - ref| / max |ref| and mean |ours - ref| / mean |ref|, then the logits' max relative difference, KL
divergence (transformers' distribution as the truth) and top-1 agreement. The first layer whose difference jumps
is where the math departs. Exits 1 when a figure is beyond its tolerance, 2 when it cannot run.

A vision-language checkpoint is run on prompts that hold an image each (`--images`, or two built-in synthetic ones):
the report first compares the preprocessed pixels with transformers' image processor, then the vision tower's hidden
states layer by layer and the projected image features (transformers gets day0jax's pixels, so each stage is
compared on the same inputs), then the language model as above.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from day0jax.core.errors import Day0Error

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_SCRIPT = ROOT / "tests" / "ref" / "reference.py"
DEFAULT_TEXTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", "Once upon a time, in a land"]
# Default tolerances per day0jax dtype (transformers runs in float32): (logits max rel, mean KL, top-1 agreement).
TOLERANCES = {"float32": (1e-3, 1e-5, 1.0), "bfloat16": (5e-2, 1e-2, 0.9), "float16": (2e-2, 5e-3, 0.95)}
# A checkpoint with quantized weights, against its unquantized source, by its coarsest kind: the rounding error of
# weight-only quantization, not arithmetic (SmolLM2-135M against float32, 3 prompts: int8 KL 2e-4, top-1 0.99;
# Q4_1 KL 2e-2, top-1 0.9). Against the dequantized weights (a GGUF's own), pass the float tolerances instead.
QUANTIZED_TOLERANCES = {"fp8": (0.25, 5e-3, 0.9), "int8": (0.25, 2e-3, 0.95), "int4": (1.0, 5e-2, 0.8)}
# The MX and NVFP4 kinds, not measured on a real model here: MXFP8 e4m3 (fp8's mantissa, power-of-two scales) is
# held as fp8; e5m2 (two mantissa bits) and the FP4 kinds as int4, the loosest measured.
QUANTIZED_TOLERANCES.update({"mxfp8_e4m3": QUANTIZED_TOLERANCES["fp8"],
                             **{k: QUANTIZED_TOLERANCES["int4"]
                                for k in ("mxfp8_e5m2", "nvfp4", "nvfp4_modelopt", "mxfp4")}})
COARSENESS = ("fp8", "mxfp8_e4m3", "int8", "mxfp8_e5m2", "int4", "nvfp4", "nvfp4_modelopt", "mxfp4")
# Preprocessing is transformers' PIL backend step for step: float32 rounding only.
PIXEL_TOLERANCE = 1e-6


class VerifyError(Day0Error):
    """The comparison could not be run (reference missing or failing, bad prompts file)."""


@dataclass
class LayerDiff:
    layer: int
    name: str
    max_rel: float
    mean_rel: float


@dataclass
class Result:
    layers: list[LayerDiff]  # the language model's hidden states; `vision`: pixels, tower layers, image features
    logits_max_rel: float
    kl_mean: float
    kl_max: float
    top1_agreement: float
    tokens: int
    tolerance: dict
    # The startup self-test's checks of the quantized weights' kernels against their dequantized reference.
    kernel_checks: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    vision: list[LayerDiff] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        return dict(asdict(self), passed=self.passed)


def default_reference_python() -> str:
    """.venv-ref/bin/python beside the project when it exists (make install builds it), else this Python."""
    ref = ROOT / ".venv-ref" / "bin" / "python"
    return str(ref) if ref.exists() else sys.executable


def read_prompts(path: Path | None, tokenizer, vocab_size: int) -> list[list[int]]:
    """Token-id prompts from a file (JSON list of strings or of id lists, or text with one prompt per line).

    Raises:
        VerifyError: unreadable file, text prompts without a tokenizer, or ids outside the vocabulary.
    """
    if path is None:
        if tokenizer is not None:
            return [tokenizer.encode(t) for t in DEFAULT_TEXTS]
        rng = np.random.default_rng(0)
        return [rng.integers(0, vocab_size, n).tolist() for n in (7, 19)]
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise VerifyError(f"--prompts {path}: cannot read ({e})") from None
    try:
        items = json.loads(text)
        if not isinstance(items, list):
            raise ValueError
    except ValueError:
        items = [line for line in text.splitlines() if line.strip()]
    prompts = []
    for item in items:
        if isinstance(item, str):
            if tokenizer is None:
                raise VerifyError(f"--prompts {path}: text prompts need a tokenizer.json in the checkpoint; "
                                  "give token ids (a JSON list of lists) instead")
            prompts.append(tokenizer.encode(item))
        elif isinstance(item, list) and item and all(isinstance(t, int) and 0 <= t < vocab_size for t in item):
            prompts.append(item)
        else:
            raise VerifyError(f"--prompts {path}: {item!r} is neither a string nor a non-empty list of token ids "
                              f"below the vocabulary size {vocab_size}")
    if not prompts:
        raise VerifyError(f"--prompts {path}: no prompts")
    return prompts


def run_reference(hf_folder: Path, prompts: list[list[int]], python: str, dtype: str = "float32",
                  timeout: int = 3600) -> dict[str, np.ndarray]:
    """transformers' hidden states and logits per prompt (the `hidden` job of tests/ref/reference.py).

    Raises:
        VerifyError: the reference script or Python is missing, or the job failed.
    """
    return _reference_job({"op": "hidden", "model": str(Path(hf_folder).absolute()), "prompts": prompts,
                           "dtype": dtype}, hf_folder, python, timeout)


def run_reference_vision(hf_folder: Path, prompts: list[list[int]], images: list[list[np.ndarray]],
                         ours: dict[str, np.ndarray], python: str, timeout: int = 3600) -> dict[str, np.ndarray]:
    """transformers' pixels (its own image processor), tower hidden states and image features (on day0jax's
    pixels), hidden states and logits per prompt (the `vl_hidden` job of tests/ref/ref_multimodal.py)."""
    with tempfile.TemporaryDirectory(prefix="day0jax-verify-") as tmp:
        inputs = Path(tmp) / "inputs.npz"
        arrays = {f"tokens_{i}": np.asarray(p, np.int32) for i, p in enumerate(prompts)}
        arrays.update({k: v for k, v in ours.items() if k.startswith(("pixels_", "grid_"))})
        arrays.update({f"image_{i}_{k}": im for i, row in enumerate(images) for k, im in enumerate(row)})
        np.savez(inputs, **arrays)
        return _reference_job({"op": "vl_hidden", "model": str(Path(hf_folder).absolute()), "inputs": str(inputs)},
                              hf_folder, python, timeout)


def _reference_job(job: dict, hf_folder: Path, python: str, timeout: int) -> dict[str, np.ndarray]:
    if not REFERENCE_SCRIPT.is_file():
        raise VerifyError(f"{REFERENCE_SCRIPT} is missing: verify needs the project's reference script")
    with tempfile.TemporaryDirectory(prefix="day0jax-verify-") as tmp:
        out = Path(tmp) / "reference.npz"
        spec = Path(tmp) / "jobs.json"
        spec.write_text(json.dumps([dict(job, out=str(out))]))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        try:
            proc = subprocess.run([python, str(REFERENCE_SCRIPT), str(spec)], capture_output=True, text=True,
                                  timeout=timeout, env=env)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise VerifyError(f"reference Python {python}: {e}") from None
        if proc.returncode:
            raise VerifyError(f"transformers ({python}) failed on {hf_folder}:\n{proc.stderr[-3000:]}")
        return dict(np.load(out))


def synthetic_images() -> list[np.ndarray]:
    """Two images that need no file: a colour gradient (300 x 200) and seeded noise over a checkerboard (97 x 131),
    of sizes that every processor resizes."""
    y, x = np.mgrid[0:200, 0:300]
    gradient = np.stack([x * 255 // 299, y * 255 // 199, (x + y) * 255 // 498], -1).astype(np.uint8)
    rng = np.random.default_rng(0)
    board = ((np.indices((131, 97)).sum(0) // 8) % 2 * 160)[..., None] + rng.integers(0, 96, (131, 97, 3))
    return [gradient, board.astype(np.uint8)]


def read_images(paths: Sequence[str | Path]) -> list[np.ndarray]:
    """The image files as uint8 RGB arrays.

    Raises:
        VerifyError: a file that cannot be read or decoded.
    """
    from day0jax.vision.images import ImageError, load_image

    out = []
    for p in paths:
        try:
            out.append(np.asarray(load_image(Path(p).read_bytes())))
        except (OSError, ImageError) as e:
            raise VerifyError(f"--images {p}: {e}") from None
    return out


def with_images(model, prompts: list[list[int]], images: list[np.ndarray]) -> list[list[int]]:
    """Each prompt with one image's placeholder tokens after its first token (images taken in turn)."""
    v = model.vision
    return [p[:1] + [v.image_token_id] * v.tokens_per_image + p[1:] for p in prompts]


def run_day0jax(model, prompts: list[list[int]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per prompt: hidden states [L+1, T, D] (module path, no cache) and logits [T, V] (the public `.logits`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from day0jax.layers.linear import exact_float32

    graphdef, params = nnx.split(model.module)

    @jax.jit
    def hidden(params, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        with exact_float32(model.dtype):
            states = nnx.merge(graphdef, params).hidden_states(tokens, positions)
        return jnp.stack(states).astype(jnp.float32)

    hiddens, logits = [], []
    for p in prompts:
        hiddens.append(np.asarray(hidden(params, jnp.asarray([p], jnp.int32)))[:, 0])
        logits.append(model.logits([p])[0])
    return hiddens, logits


def run_day0jax_vision(model, prompts: list[list[int]], images: list[list[np.ndarray]]) -> dict[str, np.ndarray]:
    """Per prompt i and its images: `pixels_{i}` (and `grid_{i}` for towers of any image size), `vision_{i}`
    [L+1, I, P, Dv] (the tower's hidden states, as far as the model computes them; towers of one image size),
    `features_{i}`, `hidden_{i}` [L+1, T, D] and `logits_{i}`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from day0jax.layers.linear import exact_float32

    graphdef, params = nnx.split(model.module)

    @jax.jit
    def tower(params, pixels):
        with exact_float32(model.dtype):
            states = nnx.merge(graphdef, params).vision_hidden_states(pixels)
        return jnp.stack(states).astype(jnp.float32)

    @jax.jit
    def hidden(params, tokens, image):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        with exact_float32(model.dtype):
            states = nnx.merge(graphdef, params).hidden_states(tokens, positions, **image)
        return jnp.stack(states).astype(jnp.float32)

    out = {}
    for i, (p, imgs) in enumerate(zip(prompts, images)):
        inputs = model.images.inputs(imgs)
        features, _ = model.images.encode(inputs)
        tokens = np.asarray([p], np.int32)
        with jax.set_mesh(model.mesh):
            states = hidden(params, tokens, model.images.arrays(tokens, [inputs]))
        out.update({f"pixels_{i}": inputs.pixels, f"features_{i}": features,
                    f"logits_{i}": model.logits([p], images=[imgs])[0], f"hidden_{i}": np.asarray(states)[:, 0]})
        if inputs.grids is not None:
            out[f"grid_{i}"] = np.asarray(inputs.grids, np.int64)
        else:
            out[f"vision_{i}"] = np.asarray(tower(params, inputs.pixels))
    return out


def compare_vision(ours: dict[str, np.ndarray], ref: dict[str, np.ndarray], n: int) -> list[LayerDiff]:
    """Rows for the pixels, each tower hidden state day0jax computes, and the image features, over `n` prompts."""
    def diff(index: int, name: str, key: str, take=lambda a: a) -> LayerDiff:
        o = [take(ours[f"{key}_{i}"]) for i in range(n)]
        r = [take(ref[f"{key}_{i}"]).reshape(np.shape(x)) for i, x in zip(range(n), o)]
        d = np.concatenate([np.abs(a - b).ravel() for a, b in zip(o, r)])
        a = np.concatenate([np.abs(b).ravel() for b in r])
        return LayerDiff(index, name, float(d.max() / max(a.max(), 1e-30)), float(d.mean() / max(a.mean(), 1e-30)))

    rows = [diff(-1, "pixels (preprocessing)", "pixels")]
    # Layers past the deepest one read are not computed; towers of any image size report their output only.
    depth = ours["vision_0"].shape[0] if "vision_0" in ours else 0
    for j in range(depth):
        rows.append(diff(j, "vision embeddings" if j == 0 else f"vision layer {j}", "vision", lambda a, j=j: a[j]))
    rows.append(diff(depth, "image features (projector)", "features"))
    return rows


def compare(ours_hidden: Sequence[np.ndarray], ours_logits: Sequence[np.ndarray], ref: dict[str, np.ndarray],
            tolerance: tuple[float, float, float]) -> Result:
    """The figures, over all prompts, and which exceed `tolerance` = (logits max rel, mean KL, top-1 agreement)."""
    n = len(ours_logits)
    layers = ours_hidden[0].shape[0]
    ref_hidden = [ref[f"hidden_{i}"] for i in range(n)]
    if ref_hidden[0].shape[0] != layers:
        raise VerifyError(f"transformers reports {ref_hidden[0].shape[0]} hidden states, day0jax {layers}")
    diffs = []
    for j in range(layers):
        d = np.concatenate([np.abs(o[j] - r[j]).ravel() for o, r in zip(ours_hidden, ref_hidden)])
        a = np.concatenate([np.abs(r[j]).ravel() for r in ref_hidden])
        name = "embeddings" if j == 0 else f"layer {j}" + (" + final norm" if j == layers - 1 else "")
        diffs.append(LayerDiff(j, name, float(d.max() / max(a.max(), 1e-30)), float(d.mean() / max(a.mean(), 1e-30))))
    ours = np.concatenate(list(ours_logits)).astype(np.float64)
    theirs = np.concatenate([ref[f"logits_{i}"] for i in range(n)]).astype(np.float64)
    if ours.shape != theirs.shape:
        raise VerifyError(f"logits shapes differ: day0jax {ours.shape}, transformers {theirs.shape}")
    logp_ref = theirs - _logsumexp(theirs)
    logp_ours = ours - _logsumexp(ours)
    kl = (np.exp(logp_ref) * (logp_ref - logp_ours)).sum(-1)
    result = Result(diffs, float(np.abs(ours - theirs).max() / np.abs(theirs).max()), float(kl.mean()),
                    float(kl.max()), float((ours.argmax(-1) == theirs.argmax(-1)).mean()), int(ours.shape[0]),
                    dict(zip(("logits_max_rel", "kl_mean", "top1_agreement"), tolerance)))
    max_rel, max_kl, min_top1 = tolerance
    if result.logits_max_rel > max_rel:
        result.failures.append(f"logits max relative difference {result.logits_max_rel:.3e} > {max_rel:.1e}")
    if result.kl_mean > max_kl:
        result.failures.append(f"mean KL divergence {result.kl_mean:.3e} > {max_kl:.1e}")
    if result.top1_agreement < min_top1:
        result.failures.append(f"top-1 agreement {result.top1_agreement:.4f} < {min_top1}")
    return result


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(-1, keepdims=True))


def verify(ckpt: str | Path, reference: str | Path, *, prompts: str | Path | None = None,
           reference_python: str | None = None, dtype: str = "float32",
           tolerance: tuple[float, float, float] | None = None, images: Sequence[str | Path] = ()) -> Result:
    """Compares a checkpoint with transformers on the same prompts; returns a `Result` (`.passed`: within tolerance).

    Args:
        ckpt: day0jax checkpoint folder.  reference: the Hugging Face folder it was converted from.
        prompts: prompts file (default: a few built-in texts, or random ids without a tokenizer).
        reference_python: the Python that has transformers and torch (default: `default_reference_python()`).
        dtype: day0jax's dtype; transformers always runs in float32.
        tolerance: (logits max rel, mean KL, min top-1 agreement), any of them None for its default: per dtype
            (`TOLERANCES`), or for a checkpoint with quantized weights per its coarsest kind
            (`QUANTIZED_TOLERANCES`); image features are held to the logits' max relative difference, pixels to
            float32 equality (1e-6).
        images: image files for a vision-language checkpoint (default: `synthetic_images()`), one per prompt in
            turn.
    Raises:
        VerifyError, and the errors of `day0jax.load`.
    """
    import day0jax

    model = day0jax.load(Path(ckpt).absolute(), dtype=dtype)
    token_prompts = read_prompts(Path(prompts) if prompts else None, model.tokenizer, model.config.vocab_size)
    python = reference_python or default_reference_python()
    tolerance = default_tolerance(Path(ckpt), dtype, tolerance)
    if model.vision is None:
        if images:
            raise VerifyError(f"--images: this {model.config.model_type} checkpoint takes no images")
        ref = run_reference(Path(reference), token_prompts, python)
        hiddens, logits = run_day0jax(model, token_prompts)
        result = compare(hiddens, logits, ref, tolerance)
        _add_kernel_checks(result, model)
        return result
    pool = read_images(images) if images else synthetic_images()
    rows = [[pool[i % len(pool)]] for i in range(len(token_prompts))]
    token_prompts = with_images(model, token_prompts, pool)
    ours = run_day0jax_vision(model, token_prompts, rows)
    ref = run_reference_vision(Path(reference), token_prompts, rows, ours, python)
    n = len(token_prompts)
    result = compare([ours[f"hidden_{i}"] for i in range(n)], [ours[f"logits_{i}"] for i in range(n)], ref,
                     tolerance)
    result.vision = compare_vision(ours, ref, n)
    pixels, features = result.vision[0], result.vision[-1]
    if pixels.max_rel > PIXEL_TOLERANCE:
        result.failures.append(f"pixels differ from transformers' image processor by {pixels.max_rel:.3e} "
                               f"(max relative) > {PIXEL_TOLERANCE:.0e}")
    if features.max_rel > tolerance[0]:
        result.failures.append(f"image features max relative difference {features.max_rel:.3e} > {tolerance[0]:.1e}")
    _add_kernel_checks(result, model)
    return result


def default_tolerance(ckpt: Path, dtype: str, given: Sequence[float | None] | None) -> tuple[float, float, float]:
    """`given`'s figures, each None (or all, when `given` is None) from `QUANTIZED_TOLERANCES` for the checkpoint's
    coarsest quantized weights, or `TOLERANCES[dtype]` for a float checkpoint."""
    from day0jax.layers.quantized import specs_from_config

    kinds = {s.kind for s in specs_from_config(json.loads((ckpt / "config.json").read_text())).values()}
    coarsest = max(kinds, key=COARSENESS.index, default=None)
    defaults = QUANTIZED_TOLERANCES[coarsest] if coarsest else TOLERANCES[dtype]
    given = given or (None, None, None)
    return tuple(default if value is None else value for value, default in zip(given, defaults))


def _add_kernel_checks(result: Result, model) -> None:
    """The quantized kernels' error against their dequantized reference, from the load's self-test: a kernel
    beyond its tolerance fails the verification (the load already replaced it by the reference)."""
    report = model.kernel_report
    result.kernel_checks = [r for r in getattr(report, "rows", []) if r.get("quantized")]
    for r in result.kernel_checks:
        if r["ok"] is False:
            result.failures.append(f"kernel {r['implementation']} on {r['case']}: relative error "
                                   f"{r['max_rel_error']} > {r['tolerance']} against its dequantized reference")


def render(result: Result) -> str:
    rows = []
    if result.vision:
        rows += [f"{'':>5}  {'images':<26}  {'max rel diff':>12}  {'mean rel diff':>13}"]
        rows += [f"{'':>5}  {d.name:<26}  {d.max_rel:>12.3e}  {d.mean_rel:>13.3e}" for d in result.vision] + [""]
    rows += [f"{'layer':>5}  {'hidden state':<26}  {'max rel diff':>12}  {'mean rel diff':>13}"]
    rows += [f"{d.layer:>5}  {d.name:<26}  {d.max_rel:>12.3e}  {d.mean_rel:>13.3e}" for d in result.layers]
    if result.kernel_checks:
        rows += ["", "quantized kernels against their dequantized reference:"]
        rows += [f"  {r['implementation']:<10} {r['case']:<70} "
                 + (f"max rel error {r['max_rel_error']:.2e}" if r["max_rel_error"] is not None else r["detail"])
                 for r in result.kernel_checks]
    t = result.tolerance
    rows += ["", f"logits over {result.tokens} tokens: max rel diff {result.logits_max_rel:.3e} "
                 f"(tolerance {t['logits_max_rel']:.1e}), KL mean {result.kl_mean:.3e} (tolerance "
                 f"{t['kl_mean']:.1e}) max {result.kl_max:.3e}, top-1 agreement {result.top1_agreement:.4f} "
                 f"(at least {t['top1_agreement']})",
             "PASS" if result.passed else "FAIL: " + "; ".join(result.failures)]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m day0jax.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", help="day0jax checkpoint folder")
    parser.add_argument("--reference", required=True, help="the Hugging Face model folder (for transformers)")
    parser.add_argument("--prompts", default=None, help="JSON list of strings or token-id lists, or one text "
                        "prompt per line")
    parser.add_argument("--reference-python", default=None, help="Python with transformers and torch "
                        f"(default: {default_reference_python()})")
    parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCES), help="day0jax's dtype")
    parser.add_argument("--tolerance", type=float, default=None, help="logits max relative difference allowed")
    parser.add_argument("--max-kl", type=float, default=None, help="mean KL divergence allowed")
    parser.add_argument("--min-top1", type=float, default=None, help="top-1 agreement required (0..1)")
    parser.add_argument("--images", nargs="+", default=(), help="image files for a vision-language checkpoint, one "
                        "per prompt in turn (default: two synthetic images)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    try:
        result = verify(args.ckpt, args.reference, prompts=args.prompts, reference_python=args.reference_python,
                        dtype=args.dtype, tolerance=(args.tolerance, args.max_kl, args.min_top1),
                        images=args.images)
    except Day0Error as e:
        print(f"day0jax verify: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2) if args.json else render(result))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
