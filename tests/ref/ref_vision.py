"""Reference jobs for vision-language models: transformers' vision towers, projectors and multimodal forwards.

Jobs (each a dict with "op"; `reference.py` dispatches to the functions here):
  qwen3_vl_vision  {config, seed, grids, out}: a tiny random `Qwen3VLVisionModel` (float32, eager attention) built
                   from the `Qwen3VLVisionConfig` keys in CONFIG, every tensor redrawn at random (biases and norms
                   too, so a tensor loaded into the wrong place shows); writes OUT/model.safetensors (its state
                   dict) and OUT/outputs.npz: `patches` [P, C*T*p*p] (random pixel patches, laid out as
                   Qwen2VLImageProcessor flattens pixel_values), `grids` [n, 3] (GRIDS, one (t, h, w) per image),
                   `embeds` [P / merge**2, out_hidden_size] (the merger's output, `pooler_output`) and
                   `deepstack_{i}` (one per deepstack_visual_indexes entry, in the order the model returns them).
"""

import os

import numpy as np
import torch


def _redraw(model, seed):
    """Every parameter drawn again: weights N(0, 1/fan_in), biases N(0, 0.1^2), norm weights N(1, 0.1^2) and the
    position table N(0, 1), so that none is zero or one by construction."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("bias"):
                p.copy_(0.1 * r)
            elif ".norm" in name:
                p.copy_(1.0 + 0.1 * r)
            elif p.ndim == 1 or name.startswith("pos_embed"):
                p.copy_(r)
            else:
                p.copy_(r / np.sqrt(p[0].numel()))


def qwen3_vl_vision(job):
    from safetensors.torch import save_file
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    torch.manual_seed(job["seed"])
    config = Qwen3VLVisionConfig(**job["config"])
    config._attn_implementation = "eager"
    model = Qwen3VLVisionModel(config).float().eval()
    _redraw(model, job["seed"])
    grids = torch.tensor(job["grids"], dtype=torch.long)
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    patches = torch.randn(int(grids.prod(-1).sum()), width, generator=torch.Generator().manual_seed(job["seed"] + 1))
    with torch.no_grad():
        out = model(patches, grid_thw=grids)
    os.makedirs(job["out"], exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(job["out"], "model.safetensors"),
              metadata={"format": "pt"})
    arrays = {"patches": patches.numpy(), "grids": grids.numpy(), "embeds": out.pooler_output.float().numpy()}
    arrays.update({f"deepstack_{i}": d.float().numpy() for i, d in enumerate(out.deepstack_features)})
    np.savez(os.path.join(job["out"], "outputs.npz"), **arrays)
