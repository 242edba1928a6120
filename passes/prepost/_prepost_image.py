"""The prepost pass's image pre-processing: the library steps, the Pillow + numpy reference, and the check
of the artifact on raw image bytes (the user's, else synthesized PNG/JPEG)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import onnx

from passes._infra import PassContext
from passes.prepost._prepost_check import Runner, apply_post, compare
from passes.prepost._prepost_graph import dims_of
from passes.prepost._prepost_options import (
    PASS_NAME,
    ImagePre,
    PrepostDependencyError,
    PrepostOptions,
    PrepostVerificationError,
    fail,
)


class ImagePlan:
    def __init__(self, pre: ImagePre, inputs: dict[str, onnx.ValueInfoProto]) -> None:
        self.pre = pre
        if len(inputs) != 1:
            raise fail(
                "PREPOST_MODEL_UNSUPPORTED",
                f"image pre-processing feeds one image input; the model has {len(inputs)}: {sorted(inputs)}",
            )
        ((self.input_name, vi),) = inputs.items()
        dims = dims_of(vi)
        elem = vi.type.tensor_type.elem_type
        if elem != onnx.TensorProto.FLOAT or len(dims) != 4:
            raise fail(
                "PREPOST_MODEL_UNSUPPORTED",
                f"input {self.input_name!r} must be float32 of rank 4 (N,C,H,W or N,H,W,C), got "
                f"{onnx.helper.tensor_dtype_to_np_dtype(elem) if elem else 'unknown'} {dims}",
            )
        if dims[1] == 3:
            self.layout, hw = "NCHW", dims[2:4]
        elif dims[3] == 3:
            self.layout, hw = "NHWC", dims[1:3]
        else:
            raise fail("PREPOST_MODEL_UNSUPPORTED", f"input {self.input_name!r} has no 3-channel axis: {dims}")
        self.size: list[int | str | None] = list(hw)

    def steps(self, ort: Any) -> list[Any]:
        pre = self.pre
        built: list[Any] = [ort.ConvertImageToBGR()]
        if pre.channels == "RGB":
            built.append(ort.ReverseAxis(axis=2, dim_value=3, name="BGRToRGB"))
        if pre.resize is not None:
            built.append(ort.Resize(pre.resize, layout="HWC"))
        if pre.crop is not None:
            built.append(ort.CenterCrop(pre.crop, pre.crop))
        if self.layout == "NCHW":
            built.append(ort.ChannelsLastToChannelsFirst())
        built.append(ort.ImageBytesToFloat(rescale_factor=pre.rescale))
        built.append(
            ort.Normalize(
                [(float(m), float(s)) for m, s in zip(pre.mean, pre.std, strict=True)],
                layout="CHW" if self.layout == "NCHW" else "HWC",
            )
        )
        built.append(ort.Unsqueeze([0]))
        return built

    # Reference: Pillow decode + numpy, the same arithmetic the graph does.
    def reference(self, data: bytes) -> np.ndarray:
        from PIL import Image

        pre = self.pre
        with Image.open(io.BytesIO(data)) as img:
            rgb = img.convert("RGB")
        h, w = rgb.height, rgb.width
        if pre.resize is not None:
            ratio = np.max(np.float32(pre.resize) / np.array([h, w], np.float32))
            nh, nw = (int(v) for v in np.round(np.array([h, w], np.float32) * ratio))
            if (nh, nw) != (h, w):
                rgb = rgb.resize((nw, nh), Image.Resampling.BILINEAR)
        arr = np.asarray(rgb, dtype=np.uint8)
        if pre.crop is not None:
            top, left = (arr.shape[0] - pre.crop) // 2, (arr.shape[1] - pre.crop) // 2
            arr = arr[top : top + pre.crop, left : left + pre.crop]
        if pre.channels == "BGR":
            arr = arr[..., ::-1]
        x = arr.astype(np.float32) * np.float32(pre.rescale)
        x = (x - np.array(pre.mean, np.float32)) / np.array(pre.std, np.float32)
        if self.layout == "NCHW":
            x = x.transpose(2, 0, 1)
        return np.ascontiguousarray(x[None].astype(np.float32))

    def _resized(self, h: int, w: int) -> bool:
        if self.pre.resize is None:
            return False
        ratio = np.max(np.float32(self.pre.resize) / np.array([h, w], np.float32))
        return tuple(int(v) for v in np.round(np.array([h, w], np.float32) * ratio)) != (h, w)

    def _synthetic(self) -> list[tuple[str, bytes]]:
        pre = self.pre
        if pre.crop is not None:
            base = (pre.crop, pre.crop) if pre.resize is None else (pre.resize, max(pre.resize, pre.crop) + 8)
        elif pre.resize is not None:
            base = (pre.resize, pre.resize)
        elif all(isinstance(d, int) for d in self.size):
            base = (int(self.size[0]), int(self.size[1]))  # type: ignore[arg-type]
        else:
            raise fail(
                "PREPOST_NO_SAMPLES",
                "the model's image size is dynamic and neither resize nor crop is set: give sample images",
            )
        images = [
            ("builtin:png", encode(pattern(*base, seed=0), "PNG")),
            ("builtin:jpeg", encode(pattern(*base, seed=1), "JPEG")),
        ]
        if pre.resize is not None:
            big = (int(base[0] * 1.5) + 3, int(base[1] * 1.75) + 5)
            images.append(("builtin:png-resized", encode(pattern(*big, seed=2), "PNG")))
        return images

    def verify(self, runner: Runner, options: PrepostOptions, ctx: PassContext) -> dict[str, Any]:
        try:
            from PIL import Image
        except ImportError as exc:
            raise PrepostDependencyError(
                f"image verification needs Pillow (pip install Pillow): {exc}", pass_name=PASS_NAME
            ) from exc
        user: list[tuple[str, bytes]] = []
        for i, sample in enumerate(ctx.samples):
            if "image" in sample:
                user.append((f"sample:{i}", np.asarray(sample["image"], dtype=np.uint8).tobytes()))
        images = user or self._synthetic()
        self.inputs = [{"image": np.frombuffer(data, np.uint8)} for _, data in images]
        checked = []
        chosen = runner.original_outputs.index(options.output) if options.output else 0
        for label, data in images:
            try:
                with Image.open(io.BytesIO(data)) as img:
                    fmt, (w, h) = img.format, img.size
                reference = self.reference(data)
            except Exception as exc:
                raise fail(
                    "PREPOST_IMAGE_DECODE_FAILED",
                    f"image {label} does not decode (Pillow: {type(exc).__name__}: {exc})",
                    sample=label,
                ) from exc
            try:
                got = runner.artifact.run(None, {"image": np.frombuffer(data, np.uint8)})
            except Exception as exc:
                raise fail(
                    "PREPOST_IMAGE_DECODE_FAILED",
                    f"the artifact fails on image {label} ({fmt}): {type(exc).__name__}: {exc}",
                    sample=label,
                ) from exc
            values = runner.original.run(None, {self.input_name: reference})
            expected = apply_post(options.post, values, chosen, None)
            if not options.post:
                expected = [values[runner.original_outputs.index(n)] for n in runner.artifact_outputs]
            lossless = fmt == "PNG" and not self._resized(h, w)
            tol = options.atol if lossless else options.lossy_atol
            result = compare(expected, got, tol, exact=lossless)
            checked.append(
                {"sample": label, "format": fmt, "size": [h, w], "resized": self._resized(h, w), "tolerance": tol}
                | result
            )
        bad = [c for c in checked if not c["ok"]]
        if bad:
            raise PrepostVerificationError(
                f"{len(bad)} of {len(checked)} image(s) out of tolerance, first {bad[0]['sample']}: "
                f"max abs {bad[0]['max_abs']:.3g} > {bad[0]['tolerance']:g}"
                + (f"; {bad[0]['problems']}" if bad[0]["problems"] else ""),
                pass_name=PASS_NAME,
                detail={"samples_checked": checked},
            )
        return {
            "samples_checked": checked,
            "samples_origin": "samples" if user else "builtin",
            "max_abs_exact": max((c["max_abs"] for c in checked if c["tolerance"] == options.atol), default=None),
            "max_abs_lossy": max((c["max_abs"] for c in checked if c["tolerance"] != options.atol), default=None),
        }


def pattern(h: int, w: int, seed: int) -> np.ndarray:
    """A deterministic RGB test image: gradients, a few blocks and mild noise (so resizing matters)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([255 * xx / max(w - 1, 1), 255 * yy / max(h - 1, 1), 127 + 100 * np.sin((xx + yy) / 7)], -1)
    for _ in range(4):
        y0, x0 = rng.integers(0, max(h - 4, 1)), rng.integers(0, max(w - 4, 1))
        img[y0 : y0 + h // 4, x0 : x0 + w // 4] = rng.integers(0, 256, size=3)
    img += rng.normal(0, 8, size=img.shape)
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def encode(pixels: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format=fmt, **({"quality": 95, "subsampling": 0} if fmt == "JPEG" else {}))
    return buf.getvalue()
