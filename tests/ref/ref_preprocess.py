"""Reference jobs for image preprocessing: transformers' image processors (their PIL backend) on test images.

Jobs (each a dict with "op"):
  image_processor_outputs {cases: [{processor, image, array?, model_processor?, kwargs?}], out}: for case i,
               transformers' PIL-backend image processor of the folder `processor` (AutoImageProcessor,
               backend="pil", so no torchvision) on the image file `image` opened with PIL (first frame), or with
               `array` on the numpy array saved at `image` (.npy), called with the `images_kwargs` of the transformers
               processor class named `model_processor` (as that processor calls it) updated with `kwargs`.
               Writes to OUT (.npz) `pixel_values_{i}` (as returned for one image: [1, 3, H, W], [1 + crops, 3, H, W]
               for Gemma 3 with pan and scan, [patches, dim] for Qwen-VL), `grid_thw_{i}` (Qwen-VL) and
               `num_crops_{i}` (Gemma 3), or `error_{i}`: the message of the ValueError transformers raised.
               With `torchvision`, the processors' torchvision backend instead, on tests/ref/plain_torchvision (a
               plain-torch rendering of the torchvision functions it calls): the job must come first in its
               subprocess, before transformers is imported, for transformers to find that package.
  video_processor_outputs {cases: [{config, video, kwargs}], out}: transformers' Qwen3VLVideoProcessor (torchvision
               backend, so with `torchvision` as above) built from the dict `config`, on the uint8 [T, H, W, 3] array
               saved at `video` (.npy) with the call keywords `kwargs` (`video_metadata` among them); writes
               `pixel_values_videos_{i}`, `video_grid_thw_{i}`, and `placeholder_{i}`: Qwen3VLProcessor's expansion
               of the video's placeholder (its `replace_video_token`, on the tokens' text "<|video_pad|>",
               "<|vision_start|>", "<|vision_end|>"), or `error_{i}`.
  torch_resizes {cases: [{image, size, mode, channels_last}], out}: torch's own antialiased `interpolate` of each
               uint8 [C, H, W] array saved at `image` (.npy) to `size` (mode "bilinear" or "bicubic"), as torchvision
               calls it on CPU tensors (optionally laid out channels-last); `resized_{i}` in OUT (.npz).
  image_loads  {images: [path], out}: for each encoded file i, `loaded_{i}`: transformers' `load_image` of the file
               as a data:image/...;base64 URL (EXIF rotation, then convert("RGB"), which drops alpha), and
               `converted_{i}`: `convert_to_rgb` of the file opened with PIL (alpha composited onto white, as image
               processors do), both uint8 [H, W, 3].
"""

import base64
import os
import sys

import numpy as np

PLAIN_TORCHVISION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plain_torchvision")


def image_processor_outputs(job):
    backend = "pil"
    if job.get("torchvision"):
        if "transformers" in sys.modules:
            raise RuntimeError("the torchvision-backend job must run before anything imports transformers")
        sys.path.insert(0, PLAIN_TORCHVISION)
        backend = "torchvision"
    import transformers
    from PIL import Image
    from transformers import AutoImageProcessor

    processors, result = {}, {}
    for i, case in enumerate(job["cases"]):
        if case["processor"] not in processors:
            processors[case["processor"]] = AutoImageProcessor.from_pretrained(case["processor"], backend=backend)
        processor = processors[case["processor"]]
        image = np.load(case["image"]) if case.get("array") else Image.open(case["image"])
        kwargs = dict(getattr(transformers, case["model_processor"]).images_kwargs if case.get("model_processor")
                      else {}, **case.get("kwargs", {}))
        try:
            out = processor(image, return_tensors="np", **kwargs)
        except ValueError as e:
            result[f"error_{i}"] = np.array(str(e))
            continue
        result[f"pixel_values_{i}"] = np.asarray(out["pixel_values"])
        if "image_grid_thw" in out:
            result[f"grid_thw_{i}"] = np.asarray(out["image_grid_thw"][0])
        if "num_crops" in out:
            result[f"num_crops_{i}"] = np.asarray(out["num_crops"][0])
        if "spatial_shapes" in out:  # LFM2-VL: (rows, columns) of patches per tile
            result[f"spatial_shapes_{i}"] = np.asarray(out["spatial_shapes"])
        if "num_soft_tokens_per_image" in out:  # Gemma 4
            result[f"num_soft_tokens_per_image_{i}"] = np.asarray(out["num_soft_tokens_per_image"][0])
    np.savez(job["out"], **result)


def video_processor_outputs(job):
    if "transformers" in sys.modules:
        raise RuntimeError("the torchvision-backend job must run before anything imports transformers")
    sys.path.insert(0, PLAIN_TORCHVISION)
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    result = {}
    for i, case in enumerate(job["cases"]):
        processor = Qwen3VLVideoProcessor(**case["config"])
        try:
            out = processor(np.load(case["video"]), return_tensors="np", return_metadata=True, **case["kwargs"])
        except ValueError as e:
            result[f"error_{i}"] = np.array(str(e))
            continue
        result[f"pixel_values_videos_{i}"] = np.asarray(out["pixel_values_videos"])
        result[f"video_grid_thw_{i}"] = np.asarray(out["video_grid_thw"][0])
        text = SimpleNamespace(video_processor=processor, video_token="<|video_pad|>",
                               vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                               _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a))
        result[f"placeholder_{i}"] = np.array(Qwen3VLProcessor.replace_video_token(text, out, 0))
    np.savez(job["out"], **result)


def torch_resizes(job):
    import torch
    import torch.nn.functional as F

    result = {}
    for i, case in enumerate(job["cases"]):
        x = torch.from_numpy(np.load(case["image"]))[None]
        if case.get("channels_last"):
            x = x.contiguous(memory_format=torch.channels_last)
        out = F.interpolate(x, size=case["size"], mode=case["mode"], antialias=True, align_corners=False)
        result[f"resized_{i}"] = out[0].contiguous().numpy()
    np.savez(job["out"], **result)


def image_loads(job):
    from io import BytesIO

    from PIL import Image
    from transformers.image_transforms import convert_to_rgb
    from transformers.image_utils import load_image

    result = {}
    for i, path in enumerate(job["images"]):
        data = open(path, "rb").read()
        url = "data:image/png;base64," + base64.b64encode(data).decode()  # transformers ignores the media type
        result[f"loaded_{i}"] = np.array(load_image(url))
        result[f"converted_{i}"] = convert_to_rgb(Image.open(BytesIO(data)), return_numpy=True)
    np.savez(job["out"], **result)
