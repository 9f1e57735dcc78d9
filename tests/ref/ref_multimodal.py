"""Reference jobs for vision-language models as a whole: transformers' image-text-to-text models on token ids and
preprocessed pixels.

  vl_run  {model, inputs, generate?, out}: INPUTS is an .npz with, per case i, `tokens_{i}` [T] (placeholders
          expanded) and `pixels_{i}` [I, ...] (the image processor's pixel_values; absent for text only), and for
          Qwen-VL models `grid_{i}` [I, 3]; videos (Qwen3-VL) as `video_pixels_{i}` (pixel_values_videos) and
          `video_grid_{i}` [V, 3]. Writes, float32, `logits_{i}` [T, V], `features_{i}` (the projected image
          features, concatenated over the images) and, with `generate`, `generated_{i}`: greedy continuations.
  vl_hidden  {model, inputs, out}: what `day0jax.verify` compares (see the function).
"""

import numpy as np
import torch


def _inputs(model, data, i):
    ids = torch.tensor(data[f"tokens_{i}"][None].astype(np.int64))
    kwargs = {}
    if f"pixels_{i}" in data:
        kwargs["pixel_values"] = torch.tensor(data[f"pixels_{i}"])
        if f"grid_{i}" in data:  # images of their own size: their grids
            kwargs["image_grid_thw"] = torch.tensor(data[f"grid_{i}"].astype(np.int64))
            if model.config.model_type == "kimi_k25":  # MoonViT's Conv2d takes each patch as [3, p, p]
                p = model.config.vision_config.patch_size
                kwargs["pixel_values"] = kwargs["pixel_values"].reshape(-1, 3, p, p)
            elif model.config.model_type == "mistral3":  # Pixtral takes images, padded to the largest, and sizes
                kwargs["pixel_values"], kwargs["image_sizes"] = _images(data[f"pixels_{i}"], data[f"grid_{i}"])
                del kwargs["image_grid_thw"]
            elif model.config.model_type == "gemma4":  # patches padded per image, (column, row) positions
                kwargs["pixel_values"], kwargs["image_position_ids"] = _gemma4_patches(data[f"pixels_{i}"],
                                                                                       data[f"grid_{i}"])
                kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).long()
                del kwargs["image_grid_thw"]
            elif model.config.model_type == "lfm2_vl":  # patches padded per tile, a mask and (rows, columns)
                parts = _lfm2_parts(data[f"grid_{i}"])
                kwargs["pixel_values"], positions = _gemma4_patches(data[f"pixels_{i}"], parts)
                kwargs["pixel_attention_mask"] = (positions[..., 0] >= 0).long()
                kwargs["spatial_shapes"] = torch.tensor([[h, w] for _, h, w in parts], dtype=torch.long)
                del kwargs["image_grid_thw"]
            else:  # Qwen-VL: which tokens are images (for multimodal RoPE)
                kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    if f"video_pixels_{i}" in data:  # Qwen3-VL videos: their patches and grids; token types 1 image, 2 video
        kwargs["pixel_values_videos"] = torch.tensor(data[f"video_pixels_{i}"])
        kwargs["video_grid_thw"] = torch.tensor(data[f"video_grid_{i}"].astype(np.int64))
        kwargs["mm_token_type_ids"] = ((ids == model.config.image_token_id).int()
                                       + 2 * (ids == model.config.video_token_id).int())
    if f"pixels_{i}" in data:
        if model.config.model_type == "gemma3":  # marks the image tokens for the bidirectional mask
            kwargs["token_type_ids"] = (ids == model.config.image_token_id).long()
    return ids, kwargs


def _images(patches, grids):
    """Images [I, 3, H, W] (zero-padded to the largest) and their sizes [I, 2] from patches of side p in raster
    order, one (1, rows, columns) grid per image."""
    p = int(round((patches.shape[1] / 3) ** 0.5))
    images, start = [], 0
    for _, rows, cols in grids:
        n = rows * cols
        images.append(patches[start:start + n].reshape(rows, cols, 3, p, p).transpose(2, 0, 3, 1, 4)
                      .reshape(3, rows * p, cols * p))
        start += n
    H, W = max(im.shape[1] for im in images), max(im.shape[2] for im in images)
    batch = np.zeros((len(images), 3, H, W), np.float32)
    for k, im in enumerate(images):
        batch[k, :, :im.shape[1], :im.shape[2]] = im
    return torch.tensor(batch), torch.tensor([im.shape[1:] for im in images], dtype=torch.long)


def _gemma4_patches(patches, grids):
    """Gemma 4's (and LFM2-VL's) pixel_values [I, P, d] (each image's patches, zero-padded to the most of them) and
    image_position_ids [I, P, 2] ((column, row), -1 on padding), from patches one after another and their grids."""
    sizes = [rows * cols for _, rows, cols in grids]
    P = max(sizes)
    values = np.zeros((len(sizes), P, patches.shape[1]), np.float32)
    positions = np.full((len(sizes), P, 2), -1, np.int64)
    start = 0
    for k, (_, rows, cols) in enumerate(grids):
        n = rows * cols
        values[k, :n] = patches[start:start + n]
        r, c = np.divmod(np.arange(n), cols)
        positions[k, :n] = np.stack([c, r], -1)
        start += n
    return torch.tensor(values), torch.tensor(positions)


def _lfm2_parts(grids):
    """LFM2-VL's grids (zero-padded to 6 entries: (1, rows, columns, tile rows, tile columns, tile side)) -> the
    (1, rows, columns) of each tile, row by row, then of the image or thumbnail."""
    parts = []
    for grid in grids.tolist():
        grid = grid + [0] * (6 - len(grid))
        parts += [(1, grid[5], grid[5])] * (grid[3] * grid[4]) + ([tuple(grid[:3])] if grid[1] * grid[2] else [])
    return parts


def _features(model, kwargs):
    args = {k: v for k, v in kwargs.items() if k in ("pixel_values", "image_grid_thw", "image_sizes",
                                                     "image_position_ids", "pixel_attention_mask", "spatial_shapes")}
    out = model.model.get_image_features(**args)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    if isinstance(feats, (list, tuple)):
        feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
    return feats.reshape(-1, feats.shape[-1]).float().numpy()


def _model_and_cases(job):
    """(the float32 model, the inputs .npz, the number of cases in it)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(job["model"], dtype=torch.float32).eval()
    data = np.load(job["inputs"])
    return model, data, len([k for k in data.files if k.startswith("tokens_")])


def vl_run(job):
    model, data, n = _model_and_cases(job)
    result = {}
    with torch.no_grad():
        for i in range(n):
            ids, kwargs = _inputs(model, data, i)
            result[f"logits_{i}"] = model(input_ids=ids, **kwargs).logits[0].float().numpy()
            if "pixel_values" in kwargs:
                result[f"features_{i}"] = _features(model, kwargs)
            if job.get("generate"):
                out = model.generate(input_ids=ids, **kwargs, max_new_tokens=job["generate"], do_sample=False,
                                     min_new_tokens=0, eos_token_id=None, pad_token_id=0)
                result[f"generated_{i}"] = out[0, ids.shape[1]:].numpy()
    np.savez(job["out"], **result)


def vl_hidden(job):
    """{model, inputs, out}: INPUTS as for `vl_run`, plus `image_{i}_{k}` (the uint8 images, HxWx3). Writes per
    case i: `pixels_{i}` (transformers' own image processor, PIL backend, on the images), `vision_{i}` [L+1, I, P, Dv]
    (the tower's hidden states on the given pixels), `features_{i}`, `hidden_{i}` [L+1, T, D] and `logits_{i}`."""
    from transformers import AutoImageProcessor

    model, data, n = _model_and_cases(job)
    processor = AutoImageProcessor.from_pretrained(job["model"], backend="pil")
    result = {}
    with torch.no_grad():
        for i in range(n):
            ids, kwargs = _inputs(model, data, i)
            images = [data[k] for k in sorted(k for k in data.files if k.startswith(f"image_{i}_"))]
            if images:
                result[f"pixels_{i}"] = np.concatenate([processor(im, return_tensors="np")["pixel_values"]
                                                        for im in images])
                if hasattr(model.model, "vision_tower"):  # towers of one image size: every hidden state
                    tower = model.model.vision_tower(pixel_values=kwargs["pixel_values"], output_hidden_states=True)
                    result[f"vision_{i}"] = torch.stack(tower.hidden_states).float().numpy()
                result[f"features_{i}"] = _features(model, kwargs)
            out = model(input_ids=ids, **kwargs, output_hidden_states=True)
            result[f"hidden_{i}"] = torch.stack([h[0] for h in out.hidden_states]).float().numpy()
            result[f"logits_{i}"] = out.logits[0].float().numpy()
    np.savez(job["out"], **result)
