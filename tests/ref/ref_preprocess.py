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
  image_loads  {images: [path], out}: for each encoded file i, `loaded_{i}`: transformers' `load_image` of the file
               as a data:image/...;base64 URL (EXIF rotation, then convert("RGB"), which drops alpha), and
               `converted_{i}`: `convert_to_rgb` of the file opened with PIL (alpha composited onto white, as image
               processors do), both uint8 [H, W, 3].
"""

import base64

import numpy as np


def image_processor_outputs(job):
    import transformers
    from PIL import Image
    from transformers import AutoImageProcessor

    processors, result = {}, {}
    for i, case in enumerate(job["cases"]):
        if case["processor"] not in processors:
            processors[case["processor"]] = AutoImageProcessor.from_pretrained(case["processor"], backend="pil")
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
