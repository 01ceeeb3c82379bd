"""deploy/: manifests valid against the Kubernetes schemas, kustomizations that resolve, and
container arguments that `qmill serve` accepts. No cluster or Docker engine is needed."""

from __future__ import annotations

import copy
import json
import pathlib
import re
import socket
from typing import Any

import kubernetes_validate
import pytest
import yaml

from qmill.cli import main as cli

DEPLOY = pathlib.Path(__file__).parents[2] / "deploy"
K8S_VERSION = kubernetes_validate.latest_version()


def _documents(path: pathlib.Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization(folder: pathlib.Path) -> dict[str, Any]:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def _merge(base: Any, patch: Any) -> Any:
    """Strategic merge as kustomize applies it to these manifests: maps merge, lists of named
    items merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value) if key in base else value
        return out
    if isinstance(base, list) and isinstance(patch, list):
        if all(isinstance(i, dict) and "name" in i for i in base + patch):
            by_name = {i["name"]: i for i in base}
            merged = [_merge(by_name[i["name"]], i) if i["name"] in by_name else i for i in patch]
            patched = {i["name"] for i in patch}
            return [i for i in base if i["name"] not in patched] + merged
        return patch
    return patch


def _render(folder: pathlib.Path) -> list[dict[str, Any]]:
    """The resources a kustomization produces (resources, patches, image tags)."""
    spec = _kustomization(folder)
    docs: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        target = folder / resource
        docs += _render(target) if target.is_dir() else _documents(target)
    for patch in spec.get("patches", []):
        body = yaml.safe_load((folder / patch["path"]).read_text())
        want = patch["target"]
        hits = [
            d for d in docs if d["kind"] == want["kind"] and d["metadata"]["name"] == want["name"]
        ]
        assert hits, f"{folder.name}: patch {patch['path']} targets nothing"
        for doc in hits:
            doc.update(_merge(doc, body))
    for image in spec.get("images", []):
        for doc in docs:
            for container in _containers(doc):
                name, _, _ = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{name}:{image['newTag']}"
    return copy.deepcopy(docs)


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])


def _serve_args(args: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


@pytest.mark.parametrize("folder", ["base", "overlays/gpu"])
def test_every_rendered_resource_validates_against_the_kubernetes_schema(folder: str) -> None:
    docs = _render(DEPLOY / folder)
    kinds = {d["kind"] for d in docs}
    assert {
        "Deployment",
        "Service",
        "ConfigMap",
        "Secret",
        "PodDisruptionBudget",
        "NetworkPolicy",
    } <= kinds
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validation_needs_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    # CI machines may have no network: the schemas (and every $ref in them) must come from the
    # package itself. Any connection attempt fails this test.
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access during validation: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    for doc in _render(DEPLOY / "overlays/gpu"):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_a_broken_manifest_is_caught_by_the_validation() -> None:
    (deployment,) = [d for d in _render(DEPLOY / "base") if d["kind"] == "Deployment"]
    deployment["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_kustomizations_name_files_that_exist() -> None:
    for kustomization in DEPLOY.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        for name in spec.get("resources", []) + [p["path"] for p in spec.get("patches", [])]:
            assert (kustomization.parent / name).exists(), f"{kustomization}: {name} missing"


def test_the_gpu_overlay_asks_for_one_gpu_and_the_cuda_image() -> None:
    (deployment,) = [d for d in _render(DEPLOY / "overlays/gpu") if d["kind"] == "Deployment"]
    (container,) = _containers(deployment)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["image"].endswith("-cuda")
    assert container["readinessProbe"]["grpc"]["port"] == 50051  # the base survived the patch


def test_container_args_are_flags_qmill_serve_accepts() -> None:
    docs = _render(DEPLOY / "base")
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = _containers(deployment)
    args = cli._parser().parse_args(["serve", *_serve_args(container["args"], config["data"])])
    assert args.tokens == "/etc/qmill/tokens.toml"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert str(pathlib.PurePath(args.tokens).parent) in mounts
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9464}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"]


def test_services_select_the_deployment_pods() -> None:
    docs = _render(DEPLOY / "base")
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    services = [d for d in docs if d["kind"] == "Service"]
    assert {s["spec"].get("clusterIP") for s in services} == {None, "None"}  # one headless
    for service in services:
        assert service["spec"]["selector"].items() <= labels.items()


def test_compose_runs_the_same_image_and_ports() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    service = compose["services"]["qmill"]
    cli._parser().parse_args(["serve", *service["command"]])
    assert {p.rsplit(":", 2)[-1] for p in service["ports"]} == {"50051", "9464"}
    assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).exists()


def test_prometheus_scrapes_the_metrics_port_by_name() -> None:
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yaml").read_text())
    (job,) = scrape["scrape_configs"]
    names = [r.get("regex") for r in job["relabel_configs"]]
    assert "metrics" in names and "qmill" in names


def _entrypoint_args() -> list[str]:
    """The `qmill serve` arguments the image's ENTRYPOINT fixes (args/command come after)."""
    (line,) = [
        line
        for line in (DEPLOY.parent / "Dockerfile").read_text().splitlines()
        if line.startswith("ENTRYPOINT ")
    ]
    entrypoint = json.loads(line.removeprefix("ENTRYPOINT "))
    assert entrypoint[:2] == ["qmill", "serve"]
    return entrypoint[2:]


def test_the_image_serves_grpc_and_metrics_on_the_ports_the_manifests_declare() -> None:
    docs = _render(DEPLOY / "base")
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = _containers(deployment)
    args = cli._parser().parse_args(
        ["serve", *_entrypoint_args(), *_serve_args(container["args"], config["data"])]
    )
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (args.host, args.port, args.metrics_port) == ("0.0.0.0", ports["grpc"], ports["metrics"])
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["qmill"]
    assert compose["image"] == container["image"]
    args = cli._parser().parse_args(["serve", *_entrypoint_args(), *compose["command"]])
    published = {int(p.rsplit(":", 1)[-1]) for p in compose["ports"]}
    assert published == {args.port, args.metrics_port}


def test_the_optional_autoscaler_targets_the_deployment_on_a_metric_the_server_exports() -> None:
    (hpa,) = _documents(DEPLOY / "extras" / "hpa.yaml")
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    (deployment,) = [d for d in _render(DEPLOY / "base") if d["kind"] == "Deployment"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] <= deployment["spec"]["replicas"]
    (metric,) = hpa["spec"]["metrics"]
    server_metrics = (DEPLOY.parent / "server" / "metrics.py").read_text()
    assert f'"{metric["pods"]["metric"]["name"]}"' in server_metrics


def test_the_job_queue_database_comes_from_a_secret_and_liveness_ignores_it() -> None:
    """The replicas share one job queue: its URL comes from a Secret through the variable the
    server reads; readiness (service "") follows the database, liveness has a name of its own
    that stays SERVING while the database is down (restarts would not help)."""
    from qmill.server import app
    from qmill.server import config as config_lib

    docs = _render(DEPLOY / "base")
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = _containers(deployment)
    env = {e["name"]: e for e in container["env"]}
    ref = env[config_lib.JOBS_DB_ENV]["valueFrom"]["secretKeyRef"]
    assert ref["key"] in secrets[ref["name"]]["stringData"]
    assert "service" not in container["readinessProbe"]["grpc"]
    assert container["livenessProbe"]["grpc"]["service"] == app.LIVENESS_NAME
