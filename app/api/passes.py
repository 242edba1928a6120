"""``/v1/passes``: the pass catalogue (names, summaries, option schemas) and the presets."""

from __future__ import annotations

from fastapi import APIRouter

from app.schemas import PassCatalogue

router = APIRouter(prefix="/v1/passes", tags=["passes"])


@router.get("", response_model=PassCatalogue, summary="List passes and presets")
def list_passes() -> PassCatalogue:
    """Every registered pass with the JSON schema of its options, and every preset with its passes."""
    from passes import registry  # deferred: pulls in onnx-ir

    return PassCatalogue.model_validate(
        {"passes": registry.catalogue(), "presets": [p.to_dict() for p in registry.PRESETS.values()]}
    )
