"""prepost through the live embedded service: the catalogue lists it, a zip upload carries the tokenizer, the
artifact takes a string, and a tokenizer path that leaves the upload fails the job with a clear code."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import onnxruntime_extensions as ortx
import pytest

from tests.conftest import FAST_PIPELINE, Services, service_env
from tests.integration._flow import wait
from tests.models.build_prepost import MINILM_TOKENIZER, tiny_bert

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def _zip_upload(base_url: str, tokenizer: str) -> dict:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("encoder.onnx", tiny_bert().SerializeToString())
        for name in TOKENIZER_FILES:  # flat, beside the model: archives hold no folders (security.md T11)
            zf.write(MINILM_TOKENIZER / name, name)
    config = {
        "passes": [
            {"name": "prepost", "options": {"pre": {"kind": "text", "tokenizer": tokenizer}, "post": ["l2norm"]}}
        ],
        "rollback_slower": False,
    }
    response = httpx.post(
        f"{base_url}/v1/jobs",
        files={"model": ("encoder.zip", buf.getvalue(), "application/zip")},
        data={"config": json.dumps(config)},
        timeout=60,
    )
    assert response.status_code == 202, response.text
    return dict(response.json())


def test_service_serves_text_artifact_and_refuses_escaping_tokenizer_when_prepost_is_asked(
    services: Services, tmp_path: Path
):
    api = services.serve(service_env(tmp_path / "data", **FAST_PIPELINE), embedded=True)

    catalogue = httpx.get(f"{api.url}/v1/passes", timeout=30).raise_for_status().json()
    (entry,) = [p for p in catalogue["passes"] if p["name"] == "prepost"]
    schema = entry["options_schema"]
    assert {"pre", "post", "samples"} <= set(schema["properties"]) and schema["additionalProperties"] is False
    assert not any("prepost" in preset["passes"] for preset in catalogue["presets"])  # opt-in only

    good = wait(api.url, _zip_upload(api.url, ".")["id"], timeout=300)
    assert good["state"] == "succeeded", good.get("error")
    artifact = tmp_path / "artifact.onnx"
    artifact.write_bytes(httpx.get(f"{api.url}/v1/jobs/{good['id']}/artifact", timeout=60).raise_for_status().content)
    options = ort.SessionOptions()
    options.register_custom_ops_library(ortx.get_library_path())
    session = ort.InferenceSession(str(artifact), options, providers=["CPUExecutionProvider"])
    (embedding,) = session.run(None, {"text": np.array(["How do I reset my password?"], dtype=object)})
    assert embedding.shape[0] == 1 and embedding.shape[-1] == 16
    assert np.allclose(np.linalg.norm(embedding, axis=-1), 1.0, atol=1e-5)  # l2norm ran in the graph
    report = httpx.get(f"{api.url}/v1/jobs/{good['id']}/report", timeout=30).raise_for_status().json()
    assert report["artifact"]["metadata_props"]["onnxforge.requires"] == "onnxruntime-extensions"

    bad = wait(api.url, _zip_upload(api.url, "../../..")["id"], timeout=300)
    assert bad["state"] == "failed"
    assert bad["error"]["code"] == "PREPOST_TOKENIZER_PATH_INVALID" and bad["error"]["pass"] == "prepost"
    assert str(tmp_path) not in bad["error"]["message"]  # no server path in what the client reads
