"""Pre-processing for EfficientNet-Lite0 in numpy: a model of the plain form, infer(inputs) -> outputs."""
import numpy as np

SHORTEST, CROP = 256, 224


def _axis(out_size, scale, offset, size):
    """Source positions of output pixels (o + offset + 0.5) / scale - 0.5, as two neighbours and a weight."""
    s = (np.arange(out_size) + offset + 0.5) / scale - 0.5
    s = np.clip(s, 0, size - 1)
    i0 = np.floor(s).astype(np.int64)
    i1 = np.minimum(i0 + 1, size - 1)
    return i0, i1, (s - i0).astype(np.float32)


def infer(inputs):
    pixels = inputs["pixels"]
    if pixels.ndim != 3 or pixels.shape[2] != 3 or min(pixels.shape[:2]) < 1:
        raise ValueError(f"pixels must be [height, width, 3] RGB, got {list(pixels.shape)}")
    h, w, _ = pixels.shape
    scale = SHORTEST / min(h, w)
    # The centre crop in the resized image's coordinates.
    off_y = np.floor((h * scale - CROP) / 2 + 1e-9)
    off_x = np.floor((w * scale - CROP) / 2 + 1e-9)
    y0, y1, wy = _axis(CROP, scale, off_y, h)
    x0, x1, wx = _axis(CROP, scale, off_x, w)
    px = pixels.astype(np.float32)
    rows = px[y0] * (1 - wy)[:, None, None] + px[y1] * wy[:, None, None]
    out = rows[:, x0] * (1 - wx)[None, :, None] + rows[:, x1] * wx[None, :, None]
    image = ((out - 127.0) / 128.0).transpose(2, 0, 1)[None]
    return {"image": np.ascontiguousarray(image, dtype=np.float32)}
