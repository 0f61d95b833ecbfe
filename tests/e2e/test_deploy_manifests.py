"""The Kubernetes manifests under deploy/kubernetes are valid and agree with the code.

Every built-in object is validated against the Kubernetes OpenAPI schemas of a
recent release (kubernetes-validate ships them, so this runs offline). KEDA's
ScaledObjects are a custom resource: they are checked against the fields of
KEDA's ``keda.sh/v1alpha1`` CRD that they use, and against what the engine
reads — the stream and consumer group each one watches are the ones
``holdfast_shared.keys`` names, its scale target is one of the Deployments,
and the address it reads is in that Deployment's environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from holdfast_shared.keys import TOOLS_GROUP, TURNS_GROUP, Keys

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"
SERVICES = {"gateway", "loop-worker", "tool-runner", "learning"}

# The part of KEDA's ScaledObject CRD (keda.sh/v1alpha1) these manifests use.
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}},
        },
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "name": {"type": "string"},
                        "kind": {"type": "string"},
                        "apiVersion": {"type": "string"},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "minReplicaCount": _INT32,
                "maxReplicaCount": _INT32,
                "idleReplicaCount": _INT32,
                "pollingInterval": _INT32,
                "cooldownPeriod": _INT32,
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["Value", "AverageValue", "Utilization"]},
                            # KEDA's trigger metadata is a map of strings only.
                            "metadata": {
                                "type": "object",
                                "additionalProperties": {"type": "string"},
                            },
                            "authenticationRef": {
                                "type": "object",
                                "required": ["name"],
                                "properties": {"name": {"type": "string"}},
                            },
                        },
                    },
                },
            },
        },
    },
}
# The redis-streams scaler's settings these manifests use (KEDA's docs).
REDIS_STREAMS = {
    "type": "object",
    "required": ["stream", "consumerGroup", "pendingEntriesCount"],
    "oneOf": [{"required": ["address"]}, {"required": ["addressFromEnv"]}],
    "properties": {"pendingEntriesCount": {"pattern": "^[1-9][0-9]*$"}},
}


def _documents() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        docs.extend(d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d)
    return docs


DOCUMENTS = _documents()


def _by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in DOCUMENTS if d["kind"] == kind}


def _config() -> dict[str, str]:
    return dict(_by_kind("ConfigMap")["holdfast"]["data"])


def test_the_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


@pytest.mark.parametrize(
    "doc",
    [d for d in DOCUMENTS if d["apiVersion"] != "keda.sh/v1alpha1"],
    ids=lambda d: f"{d['kind']}/{d['metadata']['name']}",
)
def test_kubernetes_objects_match_the_kubernetes_schemas(doc: dict[str, Any]) -> None:
    # strict: a field the schema does not know is an error (a typo is not ignored).
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_misspelt_field_is_caught() -> None:
    """The validation above is not vacuous."""
    deployment = yaml.safe_load((DEPLOY / "learning.yaml").read_text())
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    scaled = dict(_by_kind("ScaledObject")["loop-worker"])
    scaled["spec"] = {**scaled["spec"], "minReplicas": 1}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, SCALED_OBJECT)


def test_every_service_runs_as_a_deployment_of_the_image() -> None:
    deployments = _by_kind("Deployment")
    assert set(deployments) == SERVICES
    for name, deployment in deployments.items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        # The image's entrypoint is `holdfast`; its subcommand names the service.
        assert container["image"] == "holdfast"
        assert container["args"] == [name]
        sources = {next(iter(s.values()))["name"] for s in container["envFrom"]}
        assert sources == {"holdfast"}
    (migrate,) = _by_kind("Job")["holdfast-migrate"]["spec"]["template"]["spec"]["containers"]
    assert migrate["args"] == ["migrate"]


def test_scaled_objects_watch_the_engines_streams_and_groups() -> None:
    keys = Keys(prefix=_config()["HOLDFAST_REDIS_PREFIX"])
    expected = {
        "loop-worker": (keys.turns, TURNS_GROUP),
        "tool-runner": (keys.tools, TOOLS_GROUP),
    }
    scaled = _by_kind("ScaledObject")
    assert set(scaled) == set(expected)
    deployments = _by_kind("Deployment")
    for name, obj in scaled.items():
        jsonschema.validate(obj, SCALED_OBJECT)
        target = obj["spec"]["scaleTargetRef"]["name"]
        assert target == name and target in deployments
        assert obj["spec"]["minReplicaCount"] >= 1  # pending entries never reach 0 idle
        assert obj["spec"]["minReplicaCount"] <= obj["spec"]["maxReplicaCount"]
        (trigger,) = obj["spec"]["triggers"]
        assert trigger["type"] == "redis-streams"
        metadata = trigger["metadata"]
        jsonschema.validate(metadata, REDIS_STREAMS)
        assert (metadata["stream"], metadata["consumerGroup"]) == expected[name]
        # addressFromEnv is read from the scale target's environment.
        assert metadata["addressFromEnv"] in _config()
        address = _config()[metadata["addressFromEnv"]]
        assert address in _config()["HOLDFAST_REDIS_URL"]


def test_the_sandbox_runner_gets_what_bubblewrap_needs_and_nothing_more() -> None:
    pod = _by_kind("Deployment")["tool-runner"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "Unconfined"
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert "privileged" not in container.get("securityContext", {})
    env = {e["name"]: e["value"] for e in container["env"]}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert env["HOLDFAST_WORKSPACE_ROOT"] in mounts
