"""Fine-tuning against PyTorch + PEFT: the loss and its LoRA gradients, 20-step SGD and AdamW trajectories, the PEFT
export, every parameter's gradient (full fine-tuning), the jsonl data rules and the command line (LoRA and full),
on the tiny llama and qwen3 configs, and the loss and LoRA gradients of qwen3_moe, gemma3_text and deepseek_v3
(float32).

Everything day0jax computes is computed first (module fixture `runs`), then one reference subprocess runs every
torch job; each train step compiles once (the batches of a trajectory share one shape).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from conftest import run_reference
from families import FAMILIES, PROMPTS

TRAINED = ("llama", "qwen3")
# Families whose loss and LoRA gradients are checked on one batch too, with the linear maps they have: MoE
# families' attention (their experts' adapters: tests/test_train_moe_lora.py), MLA's projections but kv_b_proj
# (absorbed into attention: the layer reads its kernel, which LoRA refuses by name).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
GRADIENTS_ONLY = {"qwen3_moe": ATTENTION, "gemma3_text": None,
                  "deepseek_v3": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")}
FULL = ("llama", "qwen3", "gemma3_text")  # full fine-tuning's gradients: the dense families
STEPS, RANK, ALPHA = 20, 4, 8.0
# Rates at which the loss on 4 batches seen 5 times each falls by a third or more in 20 steps. Larger steps (or a
# larger initial B) make the trajectory chaotic: at SGD 0.5 float32 rounding grew tenfold a step, and no two
# implementations follow it. AdamW with decoupled decay, warmup and the cosine schedule.
RUNS = {"sgd": dict(optimizer="sgd", learning_rate=0.2, weight_decay=0.01),
        "adamw": dict(optimizer="adamw", learning_rate=2e-3, weight_decay=0.01, lr_schedule="cosine", warmup=3)}
# (family, run): SGD on one family, AdamW on both (each is one more compilation).
TRAJECTORIES = [("llama", "sgd"), ("llama", "adamw"), ("qwen3", "adamw")]
B_INIT = 0.1  # the initial adapter's B: N(0, B_INIT^2), so that A's gradients are not zero
# Measured on the CPU in float32 (see the report of each test): loss 1e-7 relative, gradients ~1e-6 relative L2,
# trajectories' losses ~1e-6, final adapters ~1e-5, PEFT logits ~1e-6 of the logit scale.
LOSS_RTOL, GRAD_RTOL, TRAJ_RTOL, ADAPTER_RTOL, LOGITS_RTOL = 1e-5, 1e-4, 1e-4, 1e-4, 1e-4

CHAT_ROWS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": "4."}]},
    {"prompt": "Name a colour.", "completion": "Blue, like the sky."},
    {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there!"}]},
    {"prompt": "Count to three.", "completion": "One, two, three."},
    {"prompt": "Capital of France?", "completion": "Paris."},
]
TEXT_ROWS = [{"text": "Once upon a time, there was a tiny model."}, {"text": "naïve café 日本語 🤗"}]


def batches_for(vocab: int, seed: int) -> list:
    """STEPS batches cycling through 4 of 2 rows, 12 tokens: one row padded after 9 tokens, the other's first 3
    targets masked (a prompt), so that padding and masks both take part."""
    from day0jax.train import Example, collate

    rng = np.random.default_rng(seed)
    distinct = []
    for _ in range(4):
        a, b = rng.integers(3, vocab, 12), rng.integers(3, vocab, 9)
        distinct.append(collate([Example(tuple(int(t) for t in a), 4), Example(tuple(int(t) for t in b), 0)]))
    return [distinct[i % 4] for i in range(STEPS)]


def rel_l2(ours, ref) -> float:
    return float(np.linalg.norm(np.asarray(ours) - ref) / max(np.linalg.norm(ref), 1e-30))


def logits_of(module, prompts) -> list[np.ndarray]:
    """Each prompt's logits, from one forward pass of the prompts right-padded (attention is causal)."""
    from day0jax.train.step import forward_logits, tracing

    tokens = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    with tracing():
        logits = np.asarray(jax.jit(forward_logits)(module, jnp.asarray(tokens)))
    return [logits[i, :len(p)] for i, p in enumerate(prompts)]


def lora_model(path, seed: int = 0, targets=None):
    import day0jax
    from day0jax.train import LoRAConfig, apply_lora

    model = day0jax.load(path, dtype="float32", kernels="reference")
    config = LoRAConfig(rank=RANK, alpha=ALPHA) if targets is None else \
        LoRAConfig(rank=RANK, alpha=ALPHA, targets=targets)
    return model, apply_lora(model.module, config, seed=seed)


def nonzero_adapter(model, adapters) -> dict[str, np.ndarray]:
    """The model's initial adapter with B drawn N(0, B_INIT^2), so that every gradient is nonzero."""
    from day0jax.train import adapter_arrays

    rng = np.random.default_rng(1)
    initial = adapter_arrays(model.module, adapters)
    initial.update({k: (B_INIT * rng.standard_normal(v.shape)).astype(np.float32)
                    for k, v in initial.items() if k.endswith("lora_B.weight")})
    return initial


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, data folder): a tiny Llama with SmolLM2's tokenizer and chat template, and train / valid / test
    jsonl of chat rows, for the command line."""
    from serve_tiny import write_tiny_chat_checkpoint

    root = tmp_path_factory.mktemp("chat")
    ckpt = write_tiny_chat_checkpoint(root)
    data = root / "data"
    data.mkdir()
    for split, rows in (("train", CHAT_ROWS), ("valid", CHAT_ROWS[:2]), ("test", CHAT_ROWS[2:4])):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ckpt, data


@pytest.fixture(scope="module")
def runs(tiny, converted, chat, tmp_path_factory):
    """Per family: the initial adapter (A from PEFT's initialisation, B random so that every gradient is nonzero)
    written as PEFT, day0jax's loss, gradients and logits with it, and the losses and final adapter of each
    optimizer's 20 steps; the command line's runs on a tiny chat checkpoint; then every reference job at once."""
    from day0jax.train import TrainConfig, adapter_arrays, loss_and_grads, save_adapter, train
    from day0jax.train.lora import PREFIX, load_adapter_arrays

    root = tmp_path_factory.mktemp("train")
    out, jobs = {}, []
    for name in TRAINED + tuple(GRADIENTS_ONLY):
        model, adapters = lora_model(converted[name], targets=GRADIENTS_ONLY.get(name))
        initial = nonzero_adapter(model, adapters)
        load_adapter_arrays(model.module, adapters, initial)
        folder = save_adapter(model.module, adapters, root / name / "initial", str(tiny[name]["hf"]))
        batches = batches_for(FAMILIES[name][1]["vocab_size"], seed=2)
        loss, grads = loss_and_grads(model.module, batches[0])
        flat = {".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): v
                for path, v in jax.tree_util.tree_flatten_with_path(grads)[0]}
        grads_by_hf = {}
        for hf, module in adapters.modules(model.module).items():
            owner = next(p for p, h in adapters.hf_names.items() if h == hf)
            key = ".".join(map(str, owner))
            grads_by_hf[f"{PREFIX}{hf}.lora_A.weight"] = np.asarray(flat[f"{key}.lora_a.value"])
            grads_by_hf[f"{PREFIX}{hf}.lora_B.weight"] = np.asarray(flat[f"{key}.lora_b.value"])
        if name in GRADIENTS_ONLY:  # one step at learning rate 0: its loss and first gradients
            out[name] = {"loss": loss, "grads": grads_by_hf, "runs": {}}
            jobs.append({"op": "peft_train", "model": str(tiny[name]["hf"]), "adapter": str(folder),
                         "batches": [{"tokens": batches[0].tokens.tolist(), "mask": batches[0].mask.tolist()}],
                         "optimizer": "sgd", "lrs": [0.0], "weight_decay": 0.0, "out": str(root / name / "grads.npz")})
            continue
        rec = {"folder": folder, "initial": initial, "loss": loss, "grads": grads_by_hf,
               "logits": logits_of(model.module, PROMPTS), "runs": {}}
        jobs.append({"op": "peft_logits", "model": str(tiny[name]["hf"]), "adapter": str(folder),
                     "prompts": PROMPTS, "out": str(root / name / "peft_logits.npz")})
        for run_name in [r for f, r in TRAJECTORIES if f == name]:
            kwargs = RUNS[run_name]
            load_adapter_arrays(model.module, adapters, initial)
            config = TrainConfig(iters=STEPS, steps_per_report=STEPS, **kwargs)
            result = train(model.module, batches, config, report=lambda line: None)
            rec["runs"][run_name] = {"losses": result.losses, "lrs": result.learning_rates,
                                     "final": adapter_arrays(model.module, adapters)}
            jobs.append({"op": "peft_train", "model": str(tiny[name]["hf"]), "adapter": str(folder),
                         "batches": [{"tokens": b.tokens.tolist(), "mask": b.mask.tolist()} for b in batches],
                         "optimizer": kwargs["optimizer"], "lrs": result.learning_rates,
                         "weight_decay": kwargs["weight_decay"], "out": str(root / name / f"{run_name}.npz")})
        out[name] = rec
    # Full fine-tuning of the dense families: every parameter's gradient, the model without adapters.
    import day0jax
    from day0jax.models import hf_tensor_name

    for name in FULL:
        base = day0jax.load(converted[name], dtype="float32", kernels="reference")
        batch = batches_for(FAMILIES[name][1]["vocab_size"], seed=2)[0]
        loss, grads = loss_and_grads(base.module, batch)
        params = dict(nnx.to_flat_state(nnx.state(base.module, nnx.Param)))
        full = {}
        for path, g in nnx.to_flat_state(grads):
            var = params[path]
            full[hf_tensor_name(base.config, ".".join(map(str, path)), var)] = np.asarray(g.get_value())
        out[f"full-{name}"] = {"loss": loss, "grads": full}
        jobs.append({"op": "full_grads", "model": str(tiny[name]["hf"]), "out": str(root / f"full-{name}.npz"),
                     "batch": {"tokens": batch.tokens.tolist(), "mask": batch.mask.tolist()}})

    # The command line on a tiny Llama with SmolLM2's tokenizer and chat template.
    ckpt, data = chat
    cli = {"ckpt": ckpt, "data": data}
    for label, extra in (("zero", ["--iters", "0"]),
                         ("trained", ["--iters", "4", "--batch-size", "2", "--mask-prompt", "--learning-rate", "1e-2",
                                      "--steps-per-report", "2", "--steps-per-eval", "4", "--no-shuffle"])):
        cli[label] = root / f"adapter-{label}"
        cli[f"{label}_rc"], cli[f"{label}_out"] = run_cli(["--model", str(ckpt), "--data", str(data), "--adapter-path",
                                                           str(cli[label]), "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), *extra])
    if cli["trained_rc"] == 0:
        jobs.append({"op": "peft_logits", "model": str(ckpt.parent / "tiny-chat-hf"), "adapter": str(cli["trained"]),
                     "prompts": PROMPTS, "out": str(root / "cli_peft_logits.npz")})
    jobs.append({"op": "train_rows", "model": str(ckpt.parent / "tiny-chat-hf"), "rows": CHAT_ROWS + TEXT_ROWS,
                 "out": str(root / "rows.json")})
    run_reference(jobs, root)
    for name in TRAINED:
        out[name]["ref_logits"] = dict(np.load(root / name / "peft_logits.npz"))
        for run_name in out[name]["runs"]:
            out[name]["runs"][run_name]["ref"] = dict(np.load(root / name / f"{run_name}.npz"))
    for name in FULL:
        out[f"full-{name}"]["ref"] = dict(np.load(root / f"full-{name}.npz"))
    for name in GRADIENTS_ONLY:
        out[name]["ref"] = dict(np.load(root / name / "grads.npz"))
    cli["ref_rows"] = json.loads((root / "rows.json").read_text())
    if cli["trained_rc"] == 0:
        cli["ref_logits"] = dict(np.load(root / "cli_peft_logits.npz"))
    out["cli"] = cli
    return out


def run_cli(argv: list[str]) -> tuple[int, str]:
    """`python -m day0jax.train ARGV` in this process (no second jax start): exit status and stdout + stderr."""
    from day0jax.train.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(argv)
    return rc, buf.getvalue()


@pytest.mark.parametrize("name", TRAINED + tuple(GRADIENTS_ONLY))
def test_loss_and_gradients_match_peft(runs, name):
    r = runs[name]
    # The first step's gradients: the same for every optimizer.
    ref = r["ref"] if name in GRADIENTS_ONLY else next(iter(r["runs"].values()))["ref"]
    loss_err = abs(r["loss"] - ref["losses"][0]) / ref["losses"][0]
    grad_errs = {k: rel_l2(g, ref[f"grad.{k}"]) for k, g in r["grads"].items()}
    print(f"{name}: loss {r['loss']:.6f} (relative error {loss_err:.1e}), worst gradient error "
          f"{max(grad_errs.values()):.1e} over {len(grad_errs)} tensors")
    assert set(r["grads"]) == {k[len("grad."):] for k in ref if k.startswith("grad.")}
    assert loss_err < LOSS_RTOL
    assert all(np.linalg.norm(ref[f"grad.{k}"]) > 0 for k in r["grads"])  # every adapter takes part
    assert max(grad_errs.values()) < GRAD_RTOL, sorted(grad_errs.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize("name", FULL)
def test_full_fine_tuning_gradients_match_torch(runs, name):
    """Without adapters every parameter trains: its gradient, reshaped to the HF tensor, equals torch's."""
    full = runs[f"full-{name}"]
    ref = full["ref"]
    loss_err = abs(full["loss"] - ref["loss"]) / ref["loss"]
    errs = {k: rel_l2(np.asarray(g).reshape(ref[f"grad.{k}"].shape), ref[f"grad.{k}"])
            for k, g in full["grads"].items()}
    print(f"full fine-tuning ({name}): loss error {loss_err:.1e}, worst gradient error {max(errs.values()):.1e} over "
          f"{len(errs)} tensors")
    assert set(full["grads"]) == {k[len("grad."):] for k in ref if k.startswith("grad.")}
    assert loss_err < LOSS_RTOL and max(errs.values()) < GRAD_RTOL, sorted(errs.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize("name, run_name", TRAJECTORIES)
def test_trajectory_matches_peft(runs, name, run_name):
    run = runs[name]["runs"][run_name]
    ref = run["ref"]
    losses = np.asarray(run["losses"])
    loss_err = float(np.max(np.abs(losses - ref["losses"]) / ref["losses"]))
    final_errs = {k: rel_l2(v, ref[f"param.{k}"]) for k, v in run["final"].items()}
    moved = max(rel_l2(v, runs[name]["initial"][k]) for k, v in run["final"].items())
    print(f"{name} {run_name}: losses {losses[0]:.4f} -> {losses[-1]:.4f}, worst loss error {loss_err:.1e}, "
          f"worst final adapter error {max(final_errs.values()):.1e} (the adapter moved {moved:.1e})")
    assert losses[-4:].mean() < 0.9 * losses[:4].mean()  # it trains
    assert loss_err < TRAJ_RTOL
    assert max(final_errs.values()) < ADAPTER_RTOL
    assert moved > 100 * ADAPTER_RTOL  # the comparison means something


@pytest.mark.parametrize("name", TRAINED)
def test_exported_adapter_gives_the_same_logits_in_peft(runs, name):
    r = runs[name]
    errs = []
    for i, ours in enumerate(r["logits"]):
        ref = r["ref_logits"][f"logits_{i}"]
        errs.append(float(np.abs(ours - ref).max() / np.abs(ref).max()))
    print(f"{name}: logits with the adapter, worst relative error {max(errs):.1e}")
    assert max(errs) < LOGITS_RTOL


def test_adapter_layout_is_peft(runs):
    r = runs["llama"]
    config = json.loads((r["folder"] / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK and config["lora_alpha"] == ALPHA
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    tensors = load_file(r["folder"] / "adapter_model.safetensors")
    D, N, K = 64, 4, 2
    H = D // N
    assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (RANK, D)
    assert tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (K * H, RANK)
    assert tensors["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"].shape == (RANK, N * H)
    assert tensors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].shape == (D, RANK)
    assert len(tensors) == 2 * 7 * 2


def test_adapter_saves_replace_only_adapters_and_leave_nothing_beside(converted, tmp_path):
    """A save goes into a hidden folder renamed into place (periodic saves over the same path included): the last
    save is what the folder holds, nothing else is left beside it, and a folder that is not an adapter's is refused
    with its contents untouched."""
    from day0jax.core.errors import TrainingError
    from day0jax.train import adapter_arrays, save_adapter
    from day0jax.train.lora import load_adapter_arrays

    model, adapters = lora_model(converted["llama"])
    folder = tmp_path / "adapter"
    save_adapter(model.module, adapters, folder, "base")
    arrays = adapter_arrays(model.module, adapters)
    load_adapter_arrays(model.module, adapters, {k: v + 1 for k, v in arrays.items()})
    save_adapter(model.module, adapters, folder, "base")
    saved = load_file(folder / "adapter_model.safetensors")
    assert all(np.array_equal(saved[k], arrays[k] + 1) for k in arrays)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(TrainingError, match="not a LoRA adapter folder"):
        save_adapter(model.module, adapters, other, "base")
    assert [p.name for p in other.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "notes"]


def test_cli_initial_adapter_starts_as_peft(runs):
    cli = runs["cli"]
    assert cli["zero_rc"] == 0, cli["zero_out"]
    tensors = load_file(cli["zero"] / "adapter_model.safetensors")
    a = [v for k, v in tensors.items() if k.endswith("lora_A.weight")]
    b = [v for k, v in tensors.items() if k.endswith("lora_B.weight")]
    assert len(a) == len(b) == 14 and all(not v.any() for v in b)
    for v in a:  # Kaiming-uniform as PEFT draws it: U(-1/sqrt(in), 1/sqrt(in)), std bound / sqrt(3)
        bound = 1 / math.sqrt(v.shape[1])
        assert np.abs(v).max() <= bound and abs(v.std() - bound / math.sqrt(3)) < 0.15 * bound


def test_cli_trains_reports_and_exports(runs):
    from day0jax.train.lora import load_adapter_arrays

    cli = runs["cli"]
    assert cli["trained_rc"] == 0, cli["trained_out"]
    out = cli["trained_out"]
    lines = [line for line in out.splitlines() if "train loss" in line]
    assert [line.split(":")[0] for line in lines] == ["step 2", "step 4"]
    for field in ("lr 1.000e-02", "tokens/s", "trained tokens", "peak"):
        assert field in lines[0], lines[0]
    assert "step 4: validation loss" in out and "test perplexity" in out
    # The exported adapter in PEFT on the HF model gives day0jax's logits with the same adapter loaded back.
    model, adapters = lora_model(cli["ckpt"])
    load_adapter_arrays(model.module, adapters, load_file(cli["trained"] / "adapter_model.safetensors"))
    ours = logits_of(model.module, PROMPTS)
    errs = [float(np.abs(o - cli["ref_logits"][f"logits_{i}"]).max() / np.abs(cli["ref_logits"][f"logits_{i}"]).max())
            for i, o in enumerate(ours)]
    print(f"command line adapter: logits in PEFT, worst relative error {max(errs):.1e}")
    assert max(errs) < LOGITS_RTOL
    assert any(np.abs(v).max() > 0 for k, v in load_file(cli["trained"] / "adapter_model.safetensors").items()
               if k.endswith("lora_B.weight"))


def test_cli_full_fine_tuning_writes_a_checkpoint(runs, tmp_path):
    """--fine-tune-type full trains every parameter and writes a checkpoint that loads and gives the validation loss
    the run reported."""
    import day0jax
    from convert.export_hf import export_hf
    from convert.verify import verify_checkpoint
    from day0jax.train import data, evaluate

    cli = runs["cli"]
    argv = ["--model", str(cli["ckpt"]), "--data", str(cli["data"]), "--adapter-path", str(tmp_path / "ft"),
            "--fine-tune-type", "full", "--iters", "2", "--batch-size", "2", "--learning-rate", "1e-3",
            "--steps-per-eval", "2", "--no-shuffle"]
    rc, out = run_cli(argv)
    assert rc == 0, out
    # The checkpoint carries its training state: --resume at the last step restores every parameter and the
    # optimizer state (names and shapes checked), runs no step, and writes the same weights back.
    state = tmp_path / "ft" / "training_state" / "tensors.safetensors"  # the parameters and the optimizer state
    before = load_file(state)
    rc, again = run_cli(argv + ["--resume"])
    assert rc == 0 and "resuming from step 2" in again, again
    assert verify_checkpoint(tmp_path / "ft") == []
    reported = float(out.split("step 2: validation loss ")[1].split()[0])
    tuned = day0jax.load(tmp_path / "ft", dtype="float32", kernels="reference")
    base = day0jax.load(cli["ckpt"], dtype="float32", kernels="reference")
    eos = data.eos_id(tuned.tokenizer, tuned.eos_token_ids)
    valid = data.load_split(cli["data"], "valid", tuned.tokenizer, mask_prompt=False, eos=eos, max_seq_length=2048)
    pad = data.pad_id_of(tuned.tokenizer, eos)
    losses = [evaluate(m.module, data.passes(valid, 2, pad_id=pad, multiple=32)) for m in (tuned, base)]
    print(f"full fine-tuning from the command line: validation loss {losses[1]:.4f} -> {losses[0]:.4f}")
    assert abs(losses[0] - reported) < 1e-4 and losses[0] < losses[1]
    w = np.asarray(tuned.module.model.layers[0].mlp.down_proj.kernel[...])
    assert not np.array_equal(w, np.asarray(base.module.model.layers[0].mlp.down_proj.kernel[...]))
    # Written back for transformers: the trained weights under its names (tests/test_export_hf.py has the rest).
    exported = load_file(export_hf(tmp_path / "ft", tmp_path / "ft-hf", progress=False).dst / "model.safetensors")
    assert np.array_equal(exported["model.layers.0.mlp.down_proj.weight"], w.reshape(exported[
        "model.layers.0.mlp.down_proj.weight"].shape))
    after = load_file(state)
    assert sorted(before) == sorted(after) and all(np.array_equal(before[k], after[k]) for k in before)


def test_rows_tokenize_as_transformers(runs):
    """messages / prompt-completion rendered with the chat template (the offset: the prompt with a generation
    prompt), text rows as tokenizer(text) plus EOS."""
    import day0jax
    from day0jax.train import data

    model = day0jax.load(runs["cli"]["ckpt"], dtype="float32", kernels="reference")
    eos = data.eos_id(model.tokenizer, model.eos_token_ids)
    for row, (ids, offset) in zip(CHAT_ROWS + TEXT_ROWS, runs["cli"]["ref_rows"]):
        ex = data.encode(row, model.tokenizer, mask_prompt="text" not in row, eos=eos)
        assert list(ex.tokens) == ids and ex.offset == offset, row
        assert 0 < ex.offset < len(ex.tokens) or "text" in row


def test_batching_order_and_masks():
    from day0jax.train import Example, batches, collate

    examples = [Example(tuple(range(3 + i)), i % 2 * 2) for i in range(5)]
    first = [b.tokens[:, :3].tolist() for b in itertools.islice(
        batches(examples, 2, shuffle=False), 3)]
    # File order, two at a time, starting again from the first after the last.
    assert [[row[2] for row in b] for b in first] == [[2, 2], [2, 2], [2, 2]]
    lengths = [[int(r.sum()) for r in b.real] for b in itertools.islice(
        batches(examples, 2, shuffle=False), 3)]
    assert lengths == [[3, 4], [5, 6], [7, 3]]
    a = [b.tokens.tolist() for b in itertools.islice(batches(examples, 2, seed=5), 6)]
    assert a == [b.tokens.tolist() for b in itertools.islice(batches(examples, 2, seed=5), 6)]
    assert a != [b.tokens.tolist() for b in itertools.islice(batches(examples, 2, seed=6), 6)]
    b = collate([Example((5, 6, 7, 8), 2), Example((5, 6), 0)])
    assert b.tokens.tolist() == [[5, 6, 7, 8], [5, 6, 0, 0]]
    assert b.mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]] and b.targets == 3


def test_gradient_accumulation_steps_on_the_mean_over_all_targets(runs, converted):
    """Two batches accumulated: one SGD step (rate 1) on the gradient of the mean over all their targets, each
    batch's gradient weighted by its number of targets (the batches' shapes are the trajectories': no new
    compilation of the gradient)."""
    from day0jax.train import Example, TrainConfig, adapter_arrays, collate, loss_and_grads, train
    from day0jax.train.lora import load_adapter_arrays

    model, adapters = lora_model(converted["llama"])
    initial = runs["llama"]["initial"]
    load_adapter_arrays(model.module, adapters, initial)
    first, second = batches_for(FAMILIES["llama"][1]["vocab_size"], seed=2)[:2]
    # The second with a longer prompt (same shape): unequal weights, where a plain average of the two would differ.
    second = collate([Example(tuple(int(t) for t in second.tokens[0]), 8),
                      Example(tuple(int(t) for t in second.tokens[1, :9]), 0)])
    micro = [first, second]
    assert micro[0].targets == 16 and micro[1].targets == 12 and second.tokens.shape == first.tokens.shape
    weighted = None
    for b in micro:
        _, g = loss_and_grads(model.module, b)
        g = jax.tree.map(lambda x: x * b.targets, g)
        weighted = g if weighted is None else jax.tree.map(jnp.add, weighted, g)
    total = sum(b.targets for b in micro)
    expected = {k: np.asarray(v.get_value()) / total for k, v in nnx.to_flat_state(weighted)}
    train(model.module, micro, TrainConfig(iters=1, optimizer="sgd", learning_rate=1.0, grad_accumulation=2),
          report=lambda line: None)
    final = adapter_arrays(model.module, adapters)
    by_path = {p: hf for p, hf in adapters.hf_names.items()}
    errs = []
    for path, g in expected.items():
        hf = by_path[tuple(path[:-1])]
        key = f"base_model.model.{hf}.lora_{'A' if path[-1] == 'lora_a' else 'B'}.weight"
        errs.append(rel_l2(initial[key] - final[key], g))
    assert len(errs) == 28 and max(errs) < 1e-5, max(errs)


def remat_count(jaxpr) -> int:
    """The rematerialized (checkpointed) sub-programs in a jaxpr, nested ones included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += "remat" in eqn.primitive.name or eqn.primitive.name == "checkpoint"
        n += sum(remat_count(getattr(p, "jaxpr", p)) for p in eqn.params.values()
                 if isinstance(p, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)))
    return n


def test_grad_checkpoint_gives_the_same_gradients_and_rematerializes(converted):
    """--grad-checkpoint: each decoder layer under jax.checkpoint in the training programs (one remat per layer in
    the gradient's and the optimizer step's programs, fewer saved residuals), the loss and gradients those without
    it give; inference programs untouched. Measured on the CPU (float32): the loss bit-equal, gradients within 2.4e-7
    (largest gradient 0.45): XLA fuses the recomputed forward differently."""
    import optax
    from jax.ad_checkpoint import print_saved_residuals

    from day0jax.train import loss_and_grads
    from day0jax.train.cli import parser, train_config
    from day0jax.train.lora import load_adapter_arrays
    from day0jax.train.step import _split, default_wrt, loss_sum, make_step, rematerialized_layers, tracing

    model, adapters = lora_model(converted["llama"])
    load_adapter_arrays(model.module, adapters, nonzero_adapter(model, adapters))
    batch = batches_for(FAMILIES["llama"][1]["vocab_size"], seed=2)[0]
    loss, grads = loss_and_grads(model.module, batch)  # the fixture's program (same shapes): compiled already
    loss_r, grads_r = loss_and_grads(model.module, batch, remat=True)
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_r)))
    scale = max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(grads))
    print(f"grad checkpoint: loss {loss:.7f} vs {loss_r:.7f}, worst gradient difference {err:.1e} (scale {scale:.1e})")
    assert abs(loss - loss_r) <= 1e-6 * loss and err <= 1e-6 * scale

    layers = FAMILIES["llama"][1]["num_hidden_layers"]
    graphdef, params, rest = _split(model.module, default_wrt(model.module))
    tokens, mask = jnp.asarray(batch.tokens), jnp.asarray(batch.mask)
    saved = {}
    for remat in (False, True):
        def f(p):
            with rematerialized_layers(remat):
                return loss_sum(nnx.merge(graphdef, p, rest), tokens, mask)[0]

        with tracing():
            assert remat_count(jax.make_jaxpr(jax.grad(f))(params).jaxpr) == layers * remat
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                print_saved_residuals(f, params)
        saved[remat] = len(buf.getvalue().splitlines())
    print(f"saved residuals without / with checkpointing: {saved[False]} / {saved[True]}")
    assert saved[True] < 0.7 * saved[False]
    # The optimizer step the loop compiles with --grad-checkpoint, traced (not compiled).
    config = train_config(parser().parse_args(["--model", "m", "--grad-checkpoint"]))
    assert config.grad_checkpoint
    tx = optax.sgd(0.1)
    with tracing():
        step = jax.make_jaxpr(make_step(tx, graphdef, config.grad_checkpoint))(
            params, rest, tx.init(params), tokens[None], mask[None])
    assert remat_count(step.jaxpr) == layers


def test_learning_rate_schedule():
    from day0jax.train import learning_rate
    from day0jax.train.step import schedule_fn

    lrs = [learning_rate(s, lr=1.0, schedule="cosine", warmup=2, iters=6) for s in range(1, 7)]
    assert np.allclose(lrs, [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))])
    fn = schedule_fn(lr=1.0, schedule="cosine", warmup=2, iters=6)
    assert np.allclose([float(fn(jnp.int32(s - 1))) for s in range(1, 7)], lrs, atol=1e-7)
    assert learning_rate(5, lr=2.0, schedule="constant", warmup=0, iters=9) == 2.0


def test_refusals_are_named(chat, tmp_path):
    """(MoE experts' targets and their refusals: tests/test_train_moe_lora.py.)"""
    ckpt, data = chat
    base = ["--model", str(ckpt), "--data", str(data), "--adapter-path", str(tmp_path / "a")]
    for flags, said in ((["--mesh", "dp=2"], "mesh spec 'dp=2' needs 2 devices"),
                        (["--lora-dropout", "1.0"], "--lora-dropout 1.0: must be in [0, 1)"),
                        (["--lora-targets", "nothing"], "no module named"), (["--fuse"], "--fuse needs"),
                        (["--lora-targets", "experts.gate_up_proj"],
                         "no MoE experts for ['experts.gate_up_proj'] in this llama model")):
        rc, out = run_cli(base + flags)
        assert rc == 2 and said in out, (flags, out)


def test_lora_dropout_masks_the_adapters_input_while_training(converted):
    """--lora-dropout p: within a training step each adapter's input keeps an element with probability 1 - p,
    scaled by 1 / (1 - p) (torch's inverted dropout before PEFT's lora_A); outside one (evaluation, inference) and
    without a key nothing drops. With B = 0 the forward pass does not see the masks, so B's gradient is linear in
    them: its mean over many steps' masks is the gradient without dropout. Masks follow from the seed and the step,
    so a run is reproducible (and resumes bit for bit), and another seed trains otherwise."""
    from day0jax.train import LoRAConfig, TrainConfig, apply_lora, loss_and_grads, train

    batch = batches_for(FAMILIES["llama"][1]["vocab_size"], seed=2)[0]
    import day0jax

    plain, _ = lora_model(converted["llama"])
    dropped = day0jax.load(converted["llama"], dtype="float32", kernels="reference")
    apply_lora(dropped.module, LoRAConfig(rank=RANK, alpha=ALPHA, dropout=0.5))
    loss, grads = loss_and_grads(plain.module, batch)
    loss_off, grads_off = loss_and_grads(dropped.module, batch)  # no key: no dropout
    assert loss_off == loss
    flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])  # noqa: E731
    keys = [jax.random.key(i) for i in range(64)]
    draws = [flat(loss_and_grads(dropped.module, batch, key=k)[1]) for k in keys]
    one, mean, want = draws[0], np.mean(draws, axis=0), flat(grads)
    assert np.array_equal(flat(grads_off), want)
    assert np.array_equal(flat(loss_and_grads(dropped.module, batch, key=keys[0])[1]), one)
    err_one, err_mean = rel_l2(one, want), rel_l2(mean, want)
    print(f"LoRA dropout 0.5: one step's gradient {err_one:.2f} from the gradient without dropout, the mean of 64 "
          f"{err_mean:.3f}")
    assert err_one > 0.1 and err_mean < 0.2 * err_one  # measured: 0.97 and 0.122 (the mean of 64: 1/8 of one)

    def losses(seed):
        m = day0jax.load(converted["llama"], dtype="float32", kernels="reference")
        apply_lora(m.module, LoRAConfig(rank=RANK, alpha=ALPHA, dropout=0.5))
        return train(m.module, batches_for(FAMILIES["llama"][1]["vocab_size"], seed=2)[:3],
                     TrainConfig(iters=3, optimizer="sgd", learning_rate=0.2, seed=seed),
                     report=lambda line: None).losses

    first = losses(0)
    assert losses(0) == first and losses(1)[1:] != first[1:]


def test_qlora_trains_on_an_int4_base_and_its_adapter_round_trips(chat, tmp_path):
    """LoRA on the tiny chat model converted to int4 (QLoRA): the base stays int4 codes, frozen; the adapter learns
    a small memorization set; saved as PEFT, it loads back, and served beside the int4 model it gives the logits of
    the model it was trained in. Merging it into int4 weights (--fuse) is refused by the module's name."""
    import day0jax
    from convert import convert_checkpoint
    from convert.convert import Options
    from day0jax.layers.quantized import QuantizedKernel
    from day0jax.train import (Example, LoRAConfig, TrainConfig, adapter_arrays, apply_lora, collate, save_adapter,
                               train)
    from day0jax.train.lora import load_adapter_arrays

    ckpt, _ = chat
    int4 = convert_checkpoint(ckpt.parent / "tiny-chat-hf", tmp_path / "int4", progress=False,
                              options=Options(quantize="int4", group_size=32)).dst
    model = day0jax.load(int4, dtype="float32", kernels="reference")
    adapters = apply_lora(model.module, LoRAConfig(rank=RANK, alpha=ALPHA))
    q = model.module.model.layers[0].self_attn.q_proj
    assert isinstance(q.kernel, QuantizedKernel)
    codes = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(q.kernel))}
    rng = np.random.default_rng(3)
    batch = collate([Example(tuple(int(t) for t in rng.integers(3, 1000, 24)), 0) for _ in range(2)])
    result = train(model.module, [batch] * 20, TrainConfig(iters=20, optimizer="adamw", learning_rate=1e-2,
                                                         steps_per_report=20), report=lambda line: None)
    print(f"QLoRA on int4: loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} in 20 steps")
    assert result.losses[-1] < 0.2 * result.losses[0]
    assert all(np.array_equal(np.asarray(v), codes[k]) for k, v in nnx.to_flat_state(nnx.state(q.kernel)))

    folder = save_adapter(model.module, adapters, tmp_path / "adapter", str(int4))
    trained = logits_of(model.module, PROMPTS)
    again = day0jax.load(int4, dtype="float32", kernels="reference")
    again_adapters = apply_lora(again.module, LoRAConfig(rank=RANK, alpha=ALPHA))
    load_adapter_arrays(again.module, again_adapters, dict(load_file(str(folder / "adapter_model.safetensors"))))
    assert all(np.array_equal(a, b) for a, b in zip(logits_of(again.module, PROMPTS), trained))
    assert all(np.array_equal(v, adapter_arrays(model.module, adapters)[k])
               for k, v in adapter_arrays(again.module, again_adapters).items())
    served = day0jax.load(int4, dtype="float32", kernels="reference", adapters={"memorized": str(folder)})
    errs = [np.abs(served.logits([p], adapter="memorized")[0] - want).max() / np.abs(want).max()
            for p, want in zip(PROMPTS, trained)]
    print(f"the adapter served beside the int4 model: logits within {max(errs):.1e} of the trained model's")
    assert max(errs) <= 1e-5  # measured: 5.2e-7

    rc, out = run_cli(["--fuse", "--model", str(int4), "--adapter-path", str(folder), "--out", str(tmp_path / "f")])
    assert rc == 2 and re.search(r"model\.layers\.\d\.\w+\.\w+_proj is quantized: merging an adapter", out), out


class Interrupted(Exception):
    """Stands for a run killed right after a periodic save."""


@pytest.fixture(scope="module")
def resumed(chat, tmp_path_factory):
    """The command line's run of 4 AdamW steps (cosine schedule with warmup, shuffled data crossing a pass, 2 micro-
    batches a step, gradient checkpointing on) once uninterrupted, once interrupted right after its save at step 2
    and continued with --resume: each step's loss (recorded from the optimizer step's program) and the final
    adapters."""
    import day0jax.train.lora as lora_lib
    import day0jax.train.step as step_lib

    ckpt, data = chat
    root = tmp_path_factory.mktemp("resume")
    flags = ["--model", str(ckpt), "--data", str(data), "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
             "--iters", "4", "--batch-size", "2", "--grad-accumulation", "2", "--learning-rate", "1e-2",
             "--lr-schedule", "cosine", "--warmup", "1", "--weight-decay", "0.01", "--seed", "3",
             "--steps-per-report", "1", "--grad-checkpoint"]  # the checkpointed step program, run for real
    losses: list[float] = []
    make_step, save_adapter = step_lib.make_step, lora_lib.save_adapter

    def recording(*args, **kwargs):
        step = make_step(*args, **kwargs)

        def run(*xs):
            out = step(*xs)
            losses.append(float(out[2]))
            return out
        return run

    def killed_after_save(*args, **kwargs):
        save_adapter(*args, **kwargs)
        raise Interrupted

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step_lib, "make_step", recording)
        rc, log = run_cli(flags + ["--adapter-path", str(root / "whole")])
        assert rc == 0, log
        out["whole"] = losses[:]
        losses.clear()
        with mp.context() as inner:
            inner.setattr(lora_lib, "save_adapter", killed_after_save)
            with pytest.raises(Interrupted):
                run_cli(flags + ["--adapter-path", str(root / "parts"), "--save-every", "2"])
        out["first"] = losses[:]
        losses.clear()
        out["saved"] = load_file(root / "parts" / "adapter_model.safetensors")
        rc, out["resume_log"] = run_cli(flags + ["--adapter-path", str(root / "parts"), "--save-every", "2",
                                                 "--resume"])
        assert rc == 0, out["resume_log"]
        out["rest"] = losses[:]
    out.update(root=root, flags=flags)
    return out


def test_resume_continues_bit_for_bit(resumed):
    """Interrupted after step 2 and resumed: the same per-step losses and the same final adapter as the run without
    interruption (measured on the CPU: bit-equal), the data taken from where it stood and the optimizer's moments
    and step count restored (the saved adapter differs from the final one: the resumed steps did train)."""
    whole, parts = resumed["root"] / "whole", resumed["root"] / "parts"
    print(f"losses uninterrupted {resumed['whole']}, interrupted {resumed['first']} + resumed {resumed['rest']}")
    assert len(resumed["whole"]) == 4 and resumed["first"] == resumed["whole"][:2]
    assert resumed["rest"] == resumed["whole"][2:]
    assert "resuming from step 2" in resumed["resume_log"]
    final, ours = load_file(whole / "adapter_model.safetensors"), load_file(parts / "adapter_model.safetensors")
    assert sorted(final) == sorted(ours) and all(np.array_equal(final[k], ours[k]) for k in final)
    assert any(not np.array_equal(resumed["saved"][k], ours[k]) for k in ours)
    state = json.loads((parts / "training_state" / "state.json").read_text())
    assert state["step"] == 4 and state["batches_taken"] == 8
    # Nothing is left beside the saves (each went through a hidden folder renamed into place).
    assert sorted(p.name for p in resumed["root"].iterdir()) == ["parts", "whole"]


def test_resume_refuses_a_missing_or_foreign_save(resumed, chat, tmp_path):
    """--resume without a save, or from a save of other flags or another model: a TrainingError naming the file and
    the field; a state whose tensors do not fit the run names the tensor."""
    from serve_tiny import CONFIG, write_tiny_chat_checkpoint

    flags, parts = resumed["flags"], resumed["root"] / "parts"
    other = write_tiny_chat_checkpoint(tmp_path, config=dict(CONFIG, intermediate_size=96), name="wide")
    model_at = flags.index("--model") + 1
    for argv, said in (
            (flags + ["--adapter-path", str(tmp_path / "none"), "--resume"],
             "training_state/state.json does not exist"),
            (flags + ["--adapter-path", str(parts), "--resume", "--lora-rank", "2"], "settings.lora_rank is 4"),
            (flags + ["--adapter-path", str(parts), "--resume", "--seed", "4"], "settings.seed"),
            (flags[:model_at] + [str(other)] + flags[model_at + 1:] + ["--adapter-path", str(parts), "--resume"],
             "settings.model")):
        rc, out = run_cli(argv)
        assert rc == 2 and said in out and "error: --resume" in out, (argv[-3:], out)
    # From Python, a save restored into a run of another rank: the tensor and both shapes named.
    import optax

    import day0jax
    from day0jax.core.errors import TrainingError
    from day0jax.train import LoRAConfig, apply_lora
    from day0jax.train.resume import read_state
    from day0jax.train.step import default_wrt

    state = read_state(parts, json.loads((parts / "training_state" / "state.json").read_text())["settings"])
    model = day0jax.load(chat[0], dtype="float32", kernels="reference")
    apply_lora(model.module, LoRAConfig(rank=2, alpha=ALPHA))
    params = nnx.state(model.module, default_wrt(model.module))
    with pytest.raises(TrainingError, match=r"tensors\.safetensors: tensor \"param\['model'\]\['layers'\]\[0\]\['mlp'\]"
                                            r"\['down_proj'\]\['lora_a'\]\.value\" is float32\[4, 128\], this run has "
                                            r"float32\[2, 128\]"):
        state.restore(params, optax.adamw(1e-3).init(params))


def test_fuse_writes_a_checkpoint_with_the_adapter_merged(resumed, chat, tmp_path):
    """--fuse: the adapter folded into the base (float32) as a checkpoint that loads, verifies against its manifest
    and gives the logits of the base with the adapter applied; an adapter of another model or a missing file is
    named."""
    import day0jax
    from convert.verify import verify_checkpoint
    from day0jax.train.lora import load_adapter_arrays
    from serve_tiny import CONFIG, write_tiny_chat_checkpoint

    ckpt, _ = chat
    adapter = resumed["root"] / "whole"
    rc, out = run_cli(["--fuse", "--model", str(ckpt), "--adapter-path", str(adapter), "--out",
                       str(tmp_path / "fused")])
    assert rc == 0, out
    assert verify_checkpoint(tmp_path / "fused") == []
    fused = day0jax.load(tmp_path / "fused", dtype="float32", kernels="reference")
    model, adapters = lora_model(ckpt)
    load_adapter_arrays(model.module, adapters, load_file(adapter / "adapter_model.safetensors"))
    base = day0jax.load(ckpt, dtype="float32", kernels="reference")
    ours, ref, plain = (logits_of(m, PROMPTS) for m in (fused.module, model.module, base.module))
    err = max(float(np.abs(o - r).max() / np.abs(r).max()) for o, r in zip(ours, ref))
    moved = max(float(np.abs(p - r).max() / np.abs(r).max()) for p, r in zip(plain, ref))
    print(f"fused checkpoint: logits against the base with the adapter, worst relative error {err:.1e} (the adapter "
          f"moves them by {moved:.1e})")
    assert err < 5e-6 and moved > 1e-3  # measured on the CPU: 5.6e-7 (float32 rounding of W + s B A)

    other = write_tiny_chat_checkpoint(tmp_path, config=dict(CONFIG, intermediate_size=96), name="wide")
    (tmp_path / "lonely").mkdir()
    (tmp_path / "lonely" / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    for model_path, adapter_path, said in (
            (other, adapter, "does not fit"),
            (ckpt, tmp_path / "nothing", "adapter_config.json does not exist"),
            (ckpt, tmp_path / "lonely", "adapter_model.safetensors does not exist")):
        rc, out = run_cli(["--fuse", "--model", str(model_path), "--adapter-path", str(adapter_path), "--out",
                           str(tmp_path / "refused")])
        assert rc == 2 and said in out, out
        assert "has shape" in out or said != "does not fit", out  # the tensor and both shapes named
    assert not (tmp_path / "refused").exists()
