"""The Kubernetes manifests (infra/k8s), checked without a cluster: they parse, their
`renderfarm` command lines parse with the CLI's own parser, ports and the grace period agree,
the TPU scheduling is consistent, and KEDA reads exactly the worker's queue's Redis lists."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from renderfarm.queue import priority_lists, queue_name
from tests.helpers import check_renderfarm_args

K8S = Path(__file__).resolve().parent.parent / "infra" / "k8s"


def documents() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> document, over every manifest kustomization.yaml lists."""
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    docs = {}
    for name in listed:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


DOCS = documents()


def container(deployment: str) -> dict[str, Any]:
    (only,) = DOCS[("Deployment", deployment)]["spec"]["template"]["spec"]["containers"]
    return only


def test_every_command_line_is_a_real_renderfarm_command() -> None:
    for name in ("renderfarm-worker", "renderfarm-flower"):
        check_renderfarm_args(container(name)["args"], f"infra/k8s {name}")


def test_services_reach_their_containers_ports() -> None:
    for name in ("renderfarm-redis", "renderfarm-flower"):
        ports = {p["name"]: p["containerPort"] for p in container(name)["ports"]}
        for port in DOCS[("Service", name)]["spec"]["ports"]:
            assert port["targetPort"] in ports and port["port"] == ports[port["targetPort"]], name
    assert ports_of("renderfarm-redis") == {6379}
    flower = check_renderfarm_args(container("renderfarm-flower")["args"], "flower")
    assert ports_of("renderfarm-flower") == {flower.port}
    worker = check_renderfarm_args(container("renderfarm-worker")["args"], "worker")
    assert {p["containerPort"] for p in container("renderfarm-worker")["ports"]} == {worker.metrics_port}


def ports_of(name: str) -> set[int]:
    return {p["containerPort"] for p in container(name)["ports"]}


def test_a_scaled_down_worker_has_time_to_drain() -> None:
    worker = check_renderfarm_args(container("renderfarm-worker")["args"], "worker")
    grace = DOCS[("Deployment", "renderfarm-worker")]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= worker.drain_seconds + 10


def test_the_worker_runs_on_a_tpu_slice_node_and_holds_its_chips() -> None:
    pod = DOCS[("Deployment", "renderfarm-worker")]["spec"]["template"]["spec"]
    selector = pod["nodeSelector"]
    assert selector["cloud.google.com/gke-tpu-accelerator"].startswith("tpu-")
    rows, cols = map(int, selector["cloud.google.com/gke-tpu-topology"].split("x"))
    resources = container("renderfarm-worker")["resources"]
    assert resources["requests"]["google.com/tpu"] == resources["limits"]["google.com/tpu"] == str(rows * cols)


def test_keda_sums_every_priority_list_of_the_workers_queue() -> None:
    worker = check_renderfarm_args(container("renderfarm-worker")["args"], "worker")
    scaled = DOCS[("ScaledObject", "renderfarm-worker")]["spec"]
    assert scaled["scaleTargetRef"]["name"] == "renderfarm-worker" and scaled["minReplicaCount"] == 0
    triggers = scaled["triggers"]
    assert [t["metadata"]["listName"] for t in triggers] == priority_lists(queue_name(worker.model, worker.dtype))
    assert all(t["type"] == "redis" and t["authenticationRef"]["name"] == "renderfarm-redis" for t in triggers)
    assert ("TriggerAuthentication", "renderfarm-redis") in DOCS
    formula = scaled["advanced"]["scalingModifiers"]["formula"]
    assert sorted(re.findall(r"\w+", formula)) == sorted(t["name"] for t in triggers)
    assert set(re.sub(r"[\w\s]", "", formula)) == {"+"}  # a sum, nothing else
    address = triggers[0]["metadata"]["address"]
    assert address.split(".")[0] + ":6379" == "renderfarm-redis:6379" and address.endswith(":6379")
