"""Training precision (`--dtype`, `TrainConfig.dtype`): bfloat16 forward and backward on float32 master weights.

A tiny Llama (D 64, V 256, tied embeddings) converted in bfloat16, trained from Python: an update below bfloat16's
resolution of the weights moves the float32 masters and, after a few steps, the exported bfloat16 weights (where
bfloat16 weights updated directly stay put); the masters and the optimizer's state are float32 and the step's loss is
the bfloat16 model's; bfloat16 losses track float32's; a resumed bfloat16 run equals the uninterrupted one; LoRA
trains float32 adapters on a bfloat16-only base. The command line (the tiny chat model in bfloat16): the precision
line, a full fine-tune written back in bfloat16 with its float32 masters kept for --resume. Every `train` call
compiles its step once.
"""

from __future__ import annotations

import contextlib
import io
import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

BF16 = np.dtype(ml_dtypes.bfloat16)
TINY_LR = 1e-4  # AdamW's first steps move each weight by about the rate: below bfloat16's half-ulp for |w| >= 1/32
STEPS = 4


def params_of(module) -> dict[str, np.ndarray]:
    state = nnx.state(module, nnx.Param)
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def run_cli(argv):
    from day0jax.train.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(argv)
    return rc, buf.getvalue()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny Llama (V 256) converted in bfloat16, and the tiny chat model (SmolLM2's tokenizer) in bfloat16 with a
    train.jsonl for the command line."""
    from convert import convert_checkpoint
    from serve_tiny import CONFIG, write_tiny_chat_checkpoint

    root = tmp_path_factory.mktemp("precision")
    write_tiny_chat_checkpoint(root, config=dict(CONFIG, vocab_size=256), name="small")
    write_tiny_chat_checkpoint(root, name="chat")
    for name in ("small", "chat"):
        convert_checkpoint(root / f"{name}-hf", root / f"{name}-bf16", dtype="bfloat16", progress=False)
    data = root / "data"
    data.mkdir()
    rows = [{"text": "Once upon a time, there was a tiny model."}, {"text": "It learned in bfloat16."}] * 2
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"small": root / "small-bf16", "chat": root / "chat-bf16", "data": data, "root": root}


def batch_of(seed: int):
    from day0jax.train import Example, collate

    rng = np.random.default_rng(seed)
    return collate([Example(tuple(int(t) for t in rng.integers(3, 256, 24)), 2) for _ in range(2)])


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """Full fine-tuning of the bfloat16 tiny Llama, from Python: STEPS AdamW steps at TINY_LR in bfloat16 (masters
    recorded after each, the training state saved at step 2), the same run resumed from that save, LoRA on the base
    loaded in bfloat16 (whose first loss is the bfloat16 model's own), and AdamW at 1e-2 in bfloat16 and in float32
    (the trajectories)."""
    import jax

    import day0jax
    from day0jax.train import LoRAConfig, TrainConfig, apply_lora, train
    from day0jax.train.resume import read_state, write_state

    ckpt, out = checkpoints["small"], {}
    batch = batch_of(0)
    model = day0jax.load(ckpt, dtype="float32", kernels="reference")
    out["source"] = params_of(model.module)  # bfloat16 values, widened exactly
    masters = {}

    def on_save(step, params, opt_state):
        masters[step] = {".".join(map(str, p)): np.array(v.get_value()) for p, v in nnx.to_flat_state(params)}
        if step == 2:
            out["at_2"] = jax.tree.map(np.array, (params, opt_state))
            folder = tmp_path_factory.mktemp("state")
            write_state(folder, step=2, batches_taken=2, settings={}, params=params, opt_state=opt_state)
            out["state_folder"] = folder

    config = TrainConfig(iters=STEPS, learning_rate=TINY_LR, steps_per_report=STEPS, save_every=1, dtype="bfloat16")
    result = train(model.module, [batch] * STEPS, config, on_save=on_save, report=lambda line: None)
    out.update(losses=result.losses, masters=masters, opt_state=result.opt_state, model=model)
    out["exported"] = checkpoints["root"] / "exported"
    from day0jax.train.export import save_checkpoint

    save_checkpoint(model.module, ckpt, out["exported"], dtype="bfloat16")

    resumed = day0jax.load(ckpt, dtype="float32", kernels="reference")
    saved = read_state(out["state_folder"], {})
    rest = train(resumed.module, [batch] * 2, config, resume=saved, report=lambda line: None)
    out.update(resumed_losses=rest.losses, resumed=params_of(resumed.module), saved=saved)

    # LoRA on the base loaded in bfloat16: B starts at zero, so its first loss is the bfloat16 model's own.
    lora = day0jax.load(ckpt, dtype="bfloat16", kernels="reference")
    apply_lora(lora.module, LoRAConfig(rank=4, alpha=8.0))
    out["lora_base"] = {k: v for k, v in params_of(lora.module).items() if "lora" not in k}
    r = train(lora.module, [batch] * 2, TrainConfig(iters=2, learning_rate=1e-2, steps_per_report=2, dtype="bfloat16"),
              report=lambda line: None)
    out.update(lora=lora, lora_losses=r.losses, direct_loss=r.losses[0])

    batches = [batch_of(i) for i in range(STEPS)]
    for dtype in ("bfloat16", "float32"):
        m = day0jax.load(ckpt, dtype="float32", kernels="reference")
        r = train(m.module, batches, TrainConfig(iters=STEPS, learning_rate=1e-2, steps_per_report=STEPS, dtype=dtype),
                  report=lambda line: None)
        out[f"trajectory_{dtype}"] = r.losses
    return out


def test_updates_below_bfloat16_resolution_accumulate_in_the_masters(runs):
    """One step at TINY_LR: on the weights where a step of that size is lost when rounded to bfloat16, the float32
    masters moved all the same; bfloat16 weights updated directly by the same steps stay put, while the checkpoint
    exported in bfloat16 from the masters after STEPS steps has moved."""
    import day0jax

    source, first, last = runs["source"], runs["masters"][1], runs["masters"][STEPS]
    exported = params_of(day0jax.load(runs["exported"], dtype="bfloat16", kernels="reference").module)
    lost = moved = lost_n = direct_moved = export_moved = 0
    for name, w in source.items():
        assert first[name].dtype == np.float32, name
        below = ((w + TINY_LR).astype(BF16) == w) & ((w - TINY_LR).astype(BF16) == w)  # lost in bfloat16
        lost_n += int(below.sum())
        moved += int((first[name] != w)[below].sum())
        lost += int((first[name].astype(BF16).astype(np.float32) == w)[below].sum())
        direct = w.astype(BF16)  # the same steps applied to bfloat16 weights, rounded after each
        for k in range(1, STEPS + 1):
            before = source[name] if k == 1 else runs["masters"][k - 1][name]
            direct = (direct.astype(np.float32) + (runs["masters"][k][name] - before)).astype(BF16)
        direct_moved += int((direct.astype(np.float32) != w)[below].sum())
        assert exported[name].dtype == BF16, name
        assert np.array_equal(exported[name], last[name].astype(BF16)), name
        export_moved += int((exported[name].astype(np.float32) != w)[below].sum())
    print(f"{lost_n} weights where a step of {TINY_LR} is lost in bfloat16: step 1 moved {moved / lost_n:.3f} of "
          f"their masters ({lost / lost_n:.3f} still round to the source); after {STEPS} steps bfloat16 weights "
          f"updated directly moved {direct_moved / lost_n:.4f}, the exported ones {export_moved / lost_n:.3f}")
    # Measured: 0.952 of those masters moved (the rest: embedding rows whose gradient is exactly 0, their tokens'
    # probabilities underflowing), all still round to the source; bfloat16 updated directly 0.0000; exported 0.504.
    assert lost_n > 0.5 * sum(w.size for w in source.values())
    assert moved > 0.9 * lost_n and lost == lost_n
    assert direct_moved < 0.01 * lost_n and export_moved > 0.1 * lost_n


def test_masters_and_optimizer_state_are_float32_and_the_forward_is_bfloat16(runs):
    """The optimizer's moments and the model's trained weights are float32; the first step's loss is the loss of the
    model loaded in bfloat16 (same weights: the source's; LoRA's first step there), not of the float32 model."""
    import jax

    floats = [x for x in jax.tree.leaves(runs["opt_state"]) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.float32 for x in floats)
    assert all(v.dtype == np.float32 for v in params_of(runs["model"].module).values())
    step, direct, f32 = runs["losses"][0], runs["direct_loss"], runs["trajectory_float32"][0]
    print(f"first step's loss {step:.7f}, the bfloat16 model's {direct:.7f} (|diff| {abs(step - direct):.1e}), "
          f"float32's {f32:.7f} (|diff| {abs(step - f32):.1e})")
    # Measured on the CPU: bit-equal to the bfloat16 model's (LoRA adds B = 0 exactly), 2.9e-2 from float32's.
    assert abs(step - direct) <= 1e-5 and abs(step - f32) > 10 * abs(step - direct)


def test_bfloat16_products_are_not_forced_to_float32(runs):
    """The bfloat16 step's matrix products take bfloat16 operands at the backend's default precision (float32's are
    traced at HIGHEST, true float32): lowered as `train` traces it, no product is forced to float32-exact. (Attention's
    backward multiplies its float32 softmax terms: float32 operands, default precision.)"""
    import re

    import jax

    from day0jax.train import step as step_lib

    graphdef, params, rest = nnx.split(runs["model"].module, nnx.Param, ...)
    tx = step_lib.optimizer("adamw", lambda count: 1e-3)
    tokens = jax.ShapeDtypeStruct((1, 2, 32), jnp.int32)
    with step_lib.tracing(jnp.bfloat16):
        step = step_lib.make_step(tx, graphdef, False, jnp.dtype(jnp.bfloat16))
        text = step.lower(params, rest, jax.eval_shape(tx.init, params), tokens, tokens).as_text()
    dots = re.findall(r"stablehlo\.dot_general.*", text)
    bf16 = [d for d in dots if re.search(r": \(tensor<[^>]*xbf16>, tensor<[^>]*xbf16>\)", d)]
    print(f"{len(dots)} products, {len(bf16)} of bfloat16 operands, {sum('HIGHEST' in d for d in dots)} at HIGHEST")
    # Seen: 57 products, 49 bfloat16, none at HIGHEST.
    assert len(bf16) > len(dots) / 2 and not any("HIGHEST" in d for d in dots)


def test_bfloat16_losses_track_float32(runs):
    ours, ref = np.array(runs["trajectory_bfloat16"]), np.array(runs["trajectory_float32"])
    print(f"AdamW 1e-2, {STEPS} steps: bfloat16 {ours.round(4).tolist()}, float32 {ref.round(4).tolist()}, "
          f"worst relative difference {np.abs(ours / ref - 1).max():.1e}")
    # Measured: 3.5e-3 (losses 44 -> 26; bfloat16's relative resolution is 2^-8 = 3.9e-3).
    assert np.abs(ours / ref - 1).max() < 1e-2 and ours[-1] < ours[0]


def test_resume_in_bfloat16_equals_uninterrupted(runs):
    """Resumed from the save at step 2: the float32 masters restored bit for bit, then the same losses and the same
    final masters as the run without interruption."""
    import jax

    params, opt_state = runs["at_2"]
    restored = jax.tree.leaves(runs["saved"].restore(params, opt_state))
    expected = jax.tree.leaves((params, opt_state))
    assert len(restored) == len(expected) and all(a.dtype == b.dtype and np.array_equal(a, b)
                                                  for a, b in zip(restored, expected))
    assert all(v.dtype == np.float32 for v in jax.tree.leaves(params))
    assert runs["resumed_losses"] == runs["losses"][2:]
    final = runs["masters"][STEPS]
    assert sorted(final) == sorted(runs["resumed"]) and all(np.array_equal(final[k], runs["resumed"][k]) for k in final)


def test_lora_trains_float32_adapters_on_a_bfloat16_base(runs, checkpoints):
    """The base loaded in bfloat16 stays bfloat16 (no float32 copy) and frozen; the adapters are float32 and learn.
    A base loaded in float32 for a bfloat16 run is refused, naming both."""
    import jax

    import day0jax
    from day0jax.core.errors import TrainingError
    from day0jax.layers.lora import LoRAParam
    from day0jax.train import LoRAConfig, TrainConfig, apply_lora, train

    model, base = runs["lora"], runs["lora_base"]
    after = params_of(model.module)
    assert all(v.dtype == BF16 and np.array_equal(v, after[k]) for k, v in base.items())
    adapters = jax.tree.leaves(nnx.state(model.module, LoRAParam))
    assert adapters and all(a.dtype == jnp.float32 for a in adapters)
    assert runs["lora_losses"][-1] < runs["lora_losses"][0]
    f32 = day0jax.load(checkpoints["small"], dtype="float32", kernels="reference")
    apply_lora(f32.module, LoRAConfig(rank=4, alpha=8.0))
    with pytest.raises(TrainingError, match="--dtype bfloat16: the LoRA base is loaded in float32"):
        train(f32.module, [batch_of(0)], TrainConfig(iters=1, dtype="bfloat16"), report=lambda line: None)


def test_default_precision_per_backend():
    """The default training precision from the backend's name: float32 on the CPU, bfloat16 on GPUs and TPUs, said
    in one line; float16 (which would need loss scaling) is refused."""
    from day0jax.core.errors import TrainingError
    from day0jax.train import TrainConfig
    from day0jax.train.cli import resolve_dtype
    from day0jax.train_plan import default_train_dtype

    assert default_train_dtype("cpu") == "float32"
    assert default_train_dtype("gpu") == default_train_dtype("tpu") == "bfloat16"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert resolve_dtype(None, "gpu") == "bfloat16" and resolve_dtype(None, "cpu") == "float32"
    lines = buf.getvalue().splitlines()
    assert lines == ["precision: bfloat16 forward and backward, float32 master weights, gradients and optimizer "
                     "state (the default on the gpu backend; --dtype to choose)",
                     "precision: float32 (the default on the cpu backend; --dtype to choose)"]
    with pytest.raises(TrainingError, match="--dtype 'float16' is not one of float32, bfloat16"):
        TrainConfig(dtype="float16")


def test_cli_full_fine_tune_in_bfloat16_writes_the_source_dtype_and_resumes_the_masters(checkpoints):
    """--dtype bfloat16 --fine-tune-type full on a bfloat16 checkpoint, one step: the precision line, the plan's
    compute copy, a checkpoint written in bfloat16 (the masters rounded), the float32 masters in its training state,
    which --resume restores (no step left: the same state written back)."""
    from safetensors.numpy import load_file

    import day0jax
    from day0jax.weights.checkpoint import MANIFEST

    out_dir = checkpoints["root"] / "cli-full"
    argv = ["--model", str(checkpoints["chat"]), "--data", str(checkpoints["data"]), "--adapter-path", str(out_dir),
            "--fine-tune-type", "full", "--dtype", "bfloat16", "--iters", "1", "--batch-size", "2",
            "--learning-rate", "1e-3", "--no-shuffle"]
    rc, out = run_cli(argv)
    assert rc == 0, out
    assert "precision: bfloat16 forward and backward, float32 master weights, gradients and optimizer state " \
           "(--dtype)" in out
    assert "compute copy" in out  # the memory plan counts the bfloat16 copy
    manifest = json.loads((out_dir / MANIFEST).read_text())
    assert manifest["dtype"] == "bfloat16" and json.loads((out_dir / "config.json").read_text())["dtype"] == "bfloat16"
    tuned = params_of(day0jax.load(out_dir, dtype="bfloat16", kernels="reference").module)
    state = load_file(out_dir / "training_state" / "tensors.safetensors")
    masters = {k: v for k, v in state.items() if k.startswith("param")}
    assert masters and all(v.dtype == np.float32 for v in masters.values())
    name = "model.layers.0.mlp.down_proj.kernel"
    master = masters["param['model']['layers'][0]['mlp']['down_proj']['kernel'].value"]
    assert np.array_equal(tuned[name], master.astype(BF16))
    assert not np.array_equal(master, tuned[name].astype(np.float32))  # the masters keep what bfloat16 rounds off
    rc, again = run_cli(argv + ["--resume"])
    assert rc == 0 and "resuming from step 1" in again, again
    after = load_file(out_dir / "training_state" / "tensors.safetensors")
    assert sorted(after) == sorted(state) and all(np.array_equal(after[k], state[k]) for k in state)
