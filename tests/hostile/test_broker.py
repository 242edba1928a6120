"""T15, broker exposure: what onnxforge puts on the broker, and who can reach the broker.

Celery workers trust broker data, so a message must carry nothing but the job id, as JSON (a pickle
message is refused: tests/integration/test_service_redis.py). Redis must not be reachable from outside the
stack: compose does not publish it, and the Kubernetes manifest turns the default user off (a live
redis-server with the manifest's ACL refuses an anonymous PING: tests/deploy/test_k8s_operations.py).
"""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path

import pytest
import redis
import yaml

from core.broker import TASK_NAME, Dispatcher
from core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_enqueued_message_carries_only_the_job_id_as_json_when_distributed(tmp_path, redis_url, redis_test_prefix):
    prefix = redis_test_prefix
    settings = Settings(storage={"data_dir": tmp_path}, broker={"url": redis_url, "key_prefix": prefix})
    job_id = str(uuid.uuid4())
    with Dispatcher(settings) as dispatcher:
        dispatcher.enqueue(job_id, "gpu")

    client = redis.Redis.from_url(redis_url)
    try:
        (raw,) = client.lrange(f"{prefix}gpu", 0, -1)
    finally:
        client.close()
    envelope = json.loads(raw)
    assert envelope["content-type"] == "application/json"
    assert envelope["properties"]["body_encoding"] == "base64"
    args, kwargs, embed = json.loads(base64.b64decode(envelope["body"]))
    assert (args, kwargs) == ([job_id], {})
    assert not any(embed.values())  # no callbacks, errbacks, chain or chord to run
    headers = envelope["headers"]
    assert headers["task"] == TASK_NAME
    assert (headers["argsrepr"], headers["kwargsrepr"]) == (repr([job_id]), "{}")


def test_compose_publishes_no_redis_port_when_deployed_with_compose():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    redis_service = compose["services"]["redis"]

    assert "ports" not in redis_service  # reachable only on the compose network, by service name
    assert redis_service.get("network_mode") is None  # host networking would bind it on every interface
    urls = {
        service["environment"]["ONNXFORGE_BROKER__URL"]
        for service in compose["services"].values()
        if "ONNXFORGE_BROKER__URL" in (service.get("environment") or {})
    }
    assert urls and all(url.startswith("redis://redis:") for url in urls), urls
