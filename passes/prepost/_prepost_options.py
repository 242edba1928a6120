"""The prepost pass's options and errors (``passes/prepost/prepost.py``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from core.errors import ErrorKind, PassError
from passes._infra import PassOptions

PASS_NAME = "prepost"

# ----------------------------------------------------------------------------------------------- errors


class PrepostError(PassError):
    """A prepost failure caused by the request (tokenizer, images, samples, model inputs): fix and resubmit."""

    code = "PREPOST_FAILED"
    kind = ErrorKind.INVALID_INPUT


class PrepostDependencyError(PassError):
    code = "PREPOST_DEPENDENCY_MISSING"
    kind = ErrorKind.UNAVAILABLE


class PrepostVerificationError(PassError):
    code = "PREPOST_VERIFICATION_FAILED"
    kind = ErrorKind.INTERNAL


def fail(code: str, message: str, **detail: Any) -> PrepostError:
    return PrepostError(message, code=code, pass_name=PASS_NAME, detail=detail or None)


# ---------------------------------------------------------------------------------------------- options


class ImagePre(PassOptions):
    kind: Literal["image"] = Field(description="Raw image bytes in: the input becomes `image`, uint8[num_bytes].")
    resize: int | None = Field(
        None, gt=0, description="Resize so the shorter side is this (bilinear, antialiased); none: no resize."
    )
    crop: int | None = Field(None, gt=0, description="Center crop to crop x crop after the resize; none: no crop.")
    mean: tuple[float, float, float] = Field(
        (0.0, 0.0, 0.0), description="Per-channel mean subtracted after rescaling (in `channels` order)."
    )
    std: tuple[float, float, float] = Field(
        (1.0, 1.0, 1.0), description="Per-channel standard deviation divided by after the mean."
    )
    channels: Literal["RGB", "BGR"] = Field("RGB", description="Channel order the model expects.")
    rescale: float = Field(1 / 255, gt=0, description="Pixels (0..255) are multiplied by this before the mean.")

    @model_validator(mode="after")
    def _positive_std(self) -> ImagePre:
        if any(s <= 0 for s in self.std):
            raise ValueError("std values must be > 0")
        return self


class TextPre(PassOptions):
    kind: Literal["text"] = Field(description="A string in: the input becomes `text`, string[1].")
    tokenizer: str = Field(
        description="Hugging Face tokenizer directory (in the model's archive, or a local path for the CLI)."
    )
    max_length: int | None = Field(
        None,
        ge=2,
        description="Truncate to this many tokens, keeping the end token; default: sentence_bert_config.json's "
        "max_seq_length, else the tokenizer's model_max_length when finite, else no truncation.",
    )


class TopKPost(PassOptions):
    topk: int = Field(gt=0, description="Return the k largest scores and their indices.")


class PoolPost(PassOptions):
    pool: Literal["mean"] = Field(description="Mean over the tokens, masked by the attention mask.")


PostStep = Literal["softmax", "argmax", "l2norm"] | TopKPost | PoolPost


class PrepostOptions(PassOptions):
    pre: Annotated[ImagePre | TextPre, Field(discriminator="kind")] = Field(
        description="Pre-processing: an `image` or a `text` object (see the pass description)."
    )
    post: list[PostStep] = Field(
        [],  # a plain default (pydantic copies it per instance) so the schema shows it
        description='Post-processing chain: "softmax", "argmax", {"topk": K}, {"pool": "mean"}, "l2norm".',
    )
    output: str | None = Field(None, description="Model output the post chain applies to; default: the first.")
    atol: float = Field(1e-4, gt=0, description="Max abs difference on exact samples (PNG, no resize; text).")
    lossy_atol: float = Field(
        5e-2, gt=0, description="Max abs difference where the graph's resize or JPEG decoder differs from Pillow's."
    )
    samples: list[str] = Field(
        default_factory=list, description="Sentences of the user's own: their ids must match the tokenizer's."
    )

    @model_validator(mode="after")
    def _chain(self) -> PrepostOptions:
        for i, step in enumerate(self.post):
            if (step == "argmax" or isinstance(step, TopKPost)) and i != len(self.post) - 1:
                raise ValueError("argmax and topk must end the post chain")
            if isinstance(step, PoolPost) and self.pre.kind != "text":
                raise ValueError('{"pool": "mean"} needs the text pre-processing (it is masked by its attention mask)')
        return self
