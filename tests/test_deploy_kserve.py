"""The KServe manifests (deploy/kubernetes/kserve): what kubernetes-validate knows is validated, the CRDs by hand."""

from __future__ import annotations

import json
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from infervisor.supervisor.settings.config import ConfigError, parse_config
from tests.conftest import ROOT

KSERVE = ROOT / "deploy" / "kubernetes" / "kserve"
K8S_SCHEMA_VERSION = "1.32.0"


@cache
def _documents() -> dict[str, dict[str, Any]]:
    """The rendered kustomization by kind."""
    yaml = pytest.importorskip("yaml")
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(["kubectl", "kustomize", str(KSERVE)], capture_output=True, text=True, check=True,
                         timeout=120).stdout  # fmt: skip
    return {doc["kind"]: doc for doc in yaml.safe_load_all(out) if doc}


def test_core_parts_validate_against_the_kubernetes_schemas() -> None:
    """The ConfigMap, and the runtime's containers and volumes as a Pod's, pass kubernetes-validate strictly.

    kubernetes-validate has no schema for KServe's CRDs (ServingRuntime, InferenceService): what of them is
    a core type (the pod spec KServe copies into the predictor's Deployment) is validated as that type.
    """
    validate = pytest.importorskip("kubernetes_validate")
    documents = _documents()
    assert sorted(documents) == ["ConfigMap", "InferenceService", "ServingRuntime"]
    validate.validate(documents["ConfigMap"], K8S_SCHEMA_VERSION, strict=True)
    runtime = documents["ServingRuntime"]["spec"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "infervisor-runtime"},
        "spec": {"containers": runtime["containers"], "volumes": runtime["volumes"]},
    }
    validate.validate(pod, K8S_SCHEMA_VERSION, strict=True)


def test_the_inference_service_names_what_the_runtime_serves() -> None:
    """Runtime, model format and protocol of the InferenceService are the ServingRuntime's; its port is the OIP's."""
    documents = _documents()
    runtime, service = documents["ServingRuntime"], documents["InferenceService"]
    assert (runtime["apiVersion"], service["apiVersion"]) == ("serving.kserve.io/v1alpha1", "serving.kserve.io/v1beta1")
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    config = json.loads(documents["ConfigMap"]["data"]["config.json"])
    (container,) = runtime["spec"]["containers"]
    http_port = int(config["oip"]["http"].rsplit(":", 1)[1])
    assert [p["containerPort"] for p in container["ports"]] == [http_port]
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": http_port}
    assert service["metadata"]["annotations"]["prometheus.kserve.io/port"] == config["metrics_listen"].rsplit(":")[1]


def test_the_runtime_config_is_a_valid_daemon_config(tmp_path: Path) -> None:
    """config.json parses with the model where KServe puts storageUri, and its pod-IP gateway needs the opt-in."""
    (tmp_path / "model.pt").write_bytes(b"a stand-in: the config check only needs the file")
    text = (KSERVE / "config.json").read_text().replace("/mnt/models", str(tmp_path))
    config = parse_config(text, ROOT)
    assert config.oip is not None and config.oip.http == "0.0.0.0:8080" and config.oip_allow_remote
    with pytest.raises(ConfigError, match="oip_allow_remote"):
        parse_config(json.dumps({**json.loads(text), "oip_allow_remote": False}), ROOT)
