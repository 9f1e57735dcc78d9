"""torchvision.io: present so that transformers imports; nothing here decodes (the tests pass decoded frames)."""


def read_video(*args, **kwargs):
    raise NotImplementedError("the plain-torch torchvision rendering decodes no video")


def decode_image(*args, **kwargs):
    raise NotImplementedError("the plain-torch torchvision rendering decodes no image files")


class ImageReadMode:
    RGB = "RGB"
