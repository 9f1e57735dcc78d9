"""LoRA on MoE experts' stacked weights against PyTorch + PEFT (tiny Qwen3-MoE, float32): PEFT adapts transformers'
fused expert parameters (`target_parameters=["experts.gate_up_proj", "experts.down_proj"]`, its `ParamWrapper`);
day0jax's adapters of the same names give PEFT's loss, every expert's lora_A / lora_B gradient and, once exported,
the logits `PeftModel.from_pretrained` computes; `--fuse` adds each expert's own delta to its weights. Also: which
targets adapt what, the refusals by name, the memory plan and the served adapters' refusal. (The trainer, the
optimizers and --resume take the experts' adapters as they take the others: the same `LoRAParam`s; the trajectories
against PEFT are tests/test_train.py's.)

day0jax computes everything first (module fixture `moe`), then one reference subprocess runs every torch job.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from conftest import run_reference
from families import FAMILIES, PROMPTS
from test_train import (ALPHA, GRAD_RTOL, LOGITS_RTOL, LOSS_RTOL, RANK, batches_for, logits_of, lora_model,
                        nonzero_adapter, rel_l2)

NAME = "qwen3_moe"
TARGETS = ("q_proj", "experts.gate_up_proj", "experts.down_proj")  # a linear map beside both fused parameters
E = FAMILIES[NAME][1]["num_experts"]
# Measured on the CPU (float32), printed by each test: loss 1.5e-7 relative, expert gradients 1.0e-6 relative L2,
# PEFT's logits 5.8e-7; fused weights within 9.1e-8 of base + delta (float32 rounding), fused logits 5.2e-7.
FUSE_RTOL = 5e-6


def expert_blocks(arrays: dict[str, np.ndarray], change) -> dict[str, np.ndarray]:
    """`arrays` with each expert adapter's (A, B), reshaped per expert as PEFT reads them (A [E, r, in], B
    [out, r, E]), replaced by `change(A, B)`."""
    out = dict(arrays)
    for key in arrays:
        if ".experts." in key and key.endswith("lora_A.weight"):
            b_key = key.replace("lora_A", "lora_B")
            a, b = arrays[key].reshape(E, RANK, -1), arrays[b_key].reshape(-1, RANK, E)
            a, b = change(a, b)
            out[key], out[b_key] = a.reshape(arrays[key].shape), b.reshape(arrays[b_key].shape)
    return out


# Wrong ways of applying the experts' adapters, each as the adapter that would make the right code compute it: every
# expert given its neighbour's A_e and B_e; B's columns read expert-major ([out, E, r], where PEFT's are [out, r, E]);
# the experts' adapters left out.
WRONG = {"rolled between experts": lambda a, b: (np.roll(a, 1, axis=0), np.roll(b, 1, axis=2)),
         "B read expert-major": lambda a, b: (a, b.reshape(b.shape[0], E, RANK).transpose(0, 2, 1)),
         "dropped": lambda a, b: (a, np.zeros_like(b))}


@pytest.fixture(scope="module")
def moe(tiny, converted, tmp_path_factory):
    """The adapter (A from PEFT's initialisation, B random so that every expert's delta and gradient is nonzero and
    its own) exported as PEFT; day0jax's loss, gradients and logits with it, and the logits with the WRONG variants;
    then PEFT's loss, gradients and logits with the exported folder."""
    from day0jax.train import loss_and_grads, save_adapter
    from day0jax.train.lora import PREFIX, load_adapter_arrays

    root = tmp_path_factory.mktemp("moe_lora")
    model, adapters = lora_model(converted[NAME], targets=TARGETS)
    initial = nonzero_adapter(model, adapters)
    load_adapter_arrays(model.module, adapters, initial)
    folder = save_adapter(model.module, adapters, root / "adapter", str(tiny[NAME]["hf"]))
    batch = batches_for(FAMILIES[NAME][1]["vocab_size"], seed=2)[0]
    loss, grads = loss_and_grads(model.module, batch)
    grads_by_name = {}
    for path, hf in adapters.hf_names.items():
        node = grads
        for part in path:
            node = node[part]
        grads_by_name[f"{PREFIX}{hf}.lora_A.weight"] = np.asarray(node["lora_a"].get_value())
        grads_by_name[f"{PREFIX}{hf}.lora_B.weight"] = np.asarray(node["lora_b"].get_value())
    out = {"folder": folder, "initial": initial, "loss": loss, "grads": grads_by_name,
           "logits": logits_of(model.module, PROMPTS), "wrong": {}}
    for label, change in WRONG.items():
        load_adapter_arrays(model.module, adapters, expert_blocks(initial, change))
        out["wrong"][label] = logits_of(model.module, PROMPTS)
    hf = str(tiny[NAME]["hf"])
    # One step at learning rate 0: its loss and first gradients.
    run_reference([{"op": "peft_train", "model": hf, "adapter": str(folder), "optimizer": "sgd", "weight_decay": 0.0,
                    "batches": [{"tokens": batch.tokens.tolist(), "mask": batch.mask.tolist()}], "lrs": [0.0],
                    "out": str(root / "train.npz")},
                   {"op": "peft_logits", "model": hf, "adapter": str(folder), "prompts": PROMPTS,
                    "out": str(root / "logits.npz")}], root)
    out["ref"] = dict(np.load(root / "train.npz"))
    out["ref_logits"] = [np.load(root / "logits.npz")[f"logits_{i}"] for i in range(len(PROMPTS))]
    return out


def logits_error(ours, ref) -> float:
    return max(float(np.abs(o - r).max() / np.abs(r).max()) for o, r in zip(ours, ref))


def test_loss_and_expert_gradients_match_peft(moe):
    ref = moe["ref"]
    loss_err = abs(moe["loss"] - ref["losses"][0]) / ref["losses"][0]
    errs = {k: rel_l2(g, ref[f"grad.{k}"]) for k, g in moe["grads"].items()}
    experts = {k: e for k, e in errs.items() if ".experts." in k}
    print(f"{NAME}: loss {moe['loss']:.6f} (relative error {loss_err:.1e}), worst expert gradient error "
          f"{max(experts.values()):.1e} over {len(experts)} tensors, worst of all {max(errs.values()):.1e}")
    assert set(moe["grads"]) == {k[len("grad."):] for k in ref if k.startswith("grad.")}
    assert len(experts) == 2 * 2 * FAMILIES[NAME][1]["num_hidden_layers"]  # A and B of both parameters per layer
    assert loss_err < LOSS_RTOL  # measured 1.5e-7
    assert all(np.linalg.norm(ref[f"grad.{k}"]) > 0 for k in moe["grads"])
    # Every expert's own block of A's gradient takes part (each expert gets tokens in these batches).
    for k in experts:
        if k.endswith("lora_A.weight"):
            assert all(np.abs(block).max() > 0 for block in ref[f"grad.{k}"].reshape(E, RANK, -1)), k
    assert max(errs.values()) < GRAD_RTOL, sorted(errs.items(), key=lambda kv: -kv[1])[:3]  # measured 1.1e-6


def test_exported_adapter_is_peft_and_gives_day0jax_logits(moe):
    """adapter_config.json names the fused parameters in `target_parameters`, the tensors carry PEFT's names and
    shapes (the inner wrapper, gate_up_proj, under `base_layer`), and PEFT loads the folder onto the HF model with
    day0jax's logits."""
    folder = moe["folder"]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj"] and config["lora_dropout"] == 0.0
    assert config["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    tensors = load_file(folder / "adapter_model.safetensors")
    c = FAMILIES[NAME][1]
    D, F = c["hidden_size"], c["moe_intermediate_size"]
    at = "base_model.model.model.layers.1.mlp.experts."
    assert tensors[at + "base_layer.lora_A.weight"].shape == (RANK * E, D)
    assert tensors[at + "base_layer.lora_B.weight"].shape == (2 * F, RANK * E)
    assert tensors[at + "lora_A.weight"].shape == (RANK * E, F)
    assert tensors[at + "lora_B.weight"].shape == (D, RANK * E)
    assert len(tensors) == 2 * 3 * c["num_hidden_layers"]
    err = logits_error(moe["logits"], moe["ref_logits"])
    print(f"{NAME}: logits with the expert adapters against PEFT's, worst relative error {err:.1e}")
    assert err < LOGITS_RTOL  # measured 5.8e-7


def test_misapplied_expert_adapters_are_caught(moe):
    """The comparisons above mean something: experts given each other's adapters, B's columns read in the other
    order, or the experts' adapters dropped, each moves the logits far beyond the tolerance from PEFT's."""
    errs = {label: logits_error(logits, moe["ref_logits"]) for label, logits in moe["wrong"].items()}
    print("logits against PEFT's with the expert adapters misapplied: "
          + ", ".join(f"{label} {e:.1e}" for label, e in errs.items()))
    assert all(e > 100 * LOGITS_RTOL for e in errs.values()), errs


def test_fuse_adds_each_experts_delta(moe, converted, tmp_path):
    """--fuse: each expert's stacked weights become base + alpha / r * B_e @ A_e (computed here in numpy from the
    exported tensors, as PEFT's `get_delta_weight` does), and the fused checkpoint gives the adapted logits."""
    import day0jax
    from day0jax.train.fuse import fuse

    fused = day0jax.load(fuse(converted[NAME], moe["folder"], tmp_path / "fused"), dtype="float32",
                         kernels="reference")
    base = day0jax.load(converted[NAME], dtype="float32", kernels="reference")
    tensors = load_file(moe["folder"] / "adapter_model.safetensors")
    scale, worst, largest = ALPHA / RANK, 0.0, 0.0
    for layer in range(FAMILIES[NAME][1]["num_hidden_layers"]):
        at = f"base_model.model.model.layers.{layer}.mlp.experts."
        for prefix, names in ((at + "base_layer.", ("gate_proj", "up_proj")), (at, ("down_proj",))):
            a = tensors[prefix + "lora_A.weight"].reshape(E, RANK, -1)
            b = tensors[prefix + "lora_B.weight"].reshape(-1, RANK, E)
            delta = scale * np.einsum("ore,eri->eoi", b, a)  # HF's [E, out, in]
            parts = np.split(delta, len(names), axis=1)  # gate_up_proj: gate's rows, then up's
            for name, part in zip(names, parts):
                plain = getattr(base.module.model.layers[layer].mlp.experts, name)[...]
                want = np.asarray(plain) + part.transpose(0, 2, 1)  # runtime [E, in, out]
                got = np.asarray(getattr(fused.module.model.layers[layer].mlp.experts, name)[...])
                worst, largest = max(worst, float(np.abs(got - want).max())), max(largest, float(np.abs(want).max()))
                assert float(np.abs(part).max()) > 1e-3  # every expert weight moved
    err = logits_error(logits_of(fused.module, PROMPTS), moe["logits"])
    print(f"fused experts: weights within {worst / largest:.1e} of base + delta, logits within {err:.1e} of the "
          "adapted model's")
    assert worst <= 1e-6 * largest and err < FUSE_RTOL


def test_serving_refuses_expert_adapters_by_file_and_key(moe, converted):
    import day0jax
    from day0jax.core.errors import AdapterError

    with pytest.raises(AdapterError, match=r"adapter/adapter_config\.json: target_parameters \['experts\.gate_up_proj', "
                                           r"'experts\.down_proj'\] adapts MoE experts"):
        day0jax.load(converted[NAME], dtype="float32", kernels="reference", adapters={"moe": str(moe["folder"])})


def abstract(name: str):
    from day0jax import models

    model_type, config, _ = FAMILIES[name]
    return models.abstract_model(models.config_from_hf(dict(config, model_type=model_type)))


def test_targets_rule_and_refusals():
    """Module names adapt linear maps only (as PEFT's target_modules): on Qwen3-MoE the default targets take the
    attention and leave the experts; on DeepSeek-V3 the dense layer's MLP and the shared experts too. The experts
    take adapters when their fused parameters are named; dropout with them, experts the version cannot name as PEFT
    does, experts with biases, and expert targets on a dense model are refused by name."""
    from day0jax.core.errors import TrainingError
    from day0jax.layers.lora import DENSE_TARGETS, LoRAExperts
    from day0jax.train import LoRAConfig, apply_lora
    from day0jax.train.step import default_wrt

    model = abstract(NAME)
    adapters = apply_lora(model, LoRAConfig(targets=DENSE_TARGETS))
    assert adapters.target_modules == ["k_proj", "o_proj", "q_proj", "v_proj"] and not adapters.target_parameters
    model = abstract("deepseek_v3")
    adapters = apply_lora(model, LoRAConfig(targets=DENSE_TARGETS + ("experts.down_proj",)))
    names = set(adapters.hf_names.values())
    assert {"model.layers.0.mlp.gate_proj", "model.layers.1.mlp.shared_experts.down_proj",
            "model.layers.1.mlp.experts"} <= names and "model.layers.1.mlp.experts.base_layer" not in names
    assert isinstance(model.model.layers[1].mlp.experts, LoRAExperts) and adapters.target_parameters == [
        "experts.down_proj"]
    # What the trainer differentiates, updates and saves for --resume: every adapter, the experts' among them.
    trained = {tuple(p[:-1]) for p, _ in nnx.to_flat_state(nnx.state(model, default_wrt(model)))}
    assert trained == set(adapters.hf_names) and ("model", "layers", 1, "mlp", "experts", "lora_down_proj") in trained
    for name, config, said in (
            (NAME, LoRAConfig(targets=TARGETS, dropout=0.1), "--lora-dropout 0.1 with MoE experts' targets"),
            ("mixtral", LoRAConfig(targets=TARGETS), r"mixtral: model\.layers\.0\.mlp\.experts\.gate_proj comes from "
                                                     r"'model\.layers\.0\.block_sparse_moe\.experts\.0\.w1\.weight'"),
            ("gpt_oss", LoRAConfig(targets=TARGETS), r"model\.layers\.0\.mlp\.experts: experts with biases"),
            ("llama", LoRAConfig(targets=("experts.gate_up_proj",)), r"no MoE experts for \['experts\.gate_up_proj'\]")):
        with pytest.raises(TrainingError, match=said):
            apply_lora(abstract(name), config)


def test_memory_plan_counts_expert_adapters():
    """The plan's trainable parameters are the adapters apply_lora makes, experts' included; their gradients and
    AdamW's moments follow, and the merged expert weights count among the activations."""
    from day0jax import train_plan
    from day0jax.train import LoRAConfig, apply_lora

    setup = train_plan.TrainSetup(lora_rank=RANK, lora_targets=TARGETS, max_seq_length=64)
    shape = train_plan.TrainShape.of(abstract(NAME), setup)
    model = abstract(NAME)
    adapters = apply_lora(model, LoRAConfig(rank=RANK, targets=TARGETS))
    made = sum(m.lora_a.size + m.lora_b.size for m in adapters.modules(model).values())
    p = train_plan.plan(shape, setup, None)
    dense = train_plan.plan(train_plan.TrainShape.of(abstract(NAME), train_plan.TrainSetup(
        lora_rank=RANK, lora_targets=("q_proj",), max_seq_length=64)), setup, None)
    assert p.trainable_parameters == made > dense.trainable_parameters
    assert p.gradient_bytes == p.trainable_bytes == 4 * made and p.optimizer_bytes == 2 * 4 * made
    c = FAMILIES[NAME][1]
    layers, D, F = c["num_hidden_layers"], c["hidden_size"], c["moe_intermediate_size"]
    assert shape.lora_merged == layers * 2 * (E * D * 2 * F + E * F * D)
    assert p.activation_bytes > dense.activation_bytes
