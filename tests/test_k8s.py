"""The Kubernetes manifests (infra/k8s), checked without a cluster: they parse, their
`renderfarm` command lines parse with the CLI's own parser, ports and the grace period agree,
the TPU scheduling is consistent, and KEDA reads exactly the worker's queue's Redis lists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from renderfarm.connections import sentinels_of
from renderfarm.queue import priority_lists, queue_name
from tests.helpers import check_renderfarm_args, heredoc, redis_options, sentinel_master

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


# -- the Sentinel overlay (infra/k8s/sentinel) ------------------------------------------------

OVERLAY = K8S / "sentinel"


def overlay() -> tuple[dict[str, Any], dict[tuple[str, str], dict[str, Any]]]:
    """The overlay's kustomization and its documents, (kind, name) -> document: it builds on the
    base and lists every file it holds."""
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert kustomization["resources"][0] == ".." and (K8S / "kustomization.yaml").exists()
    files = kustomization["resources"][1:] + [patch["path"] for patch in kustomization["patches"]]
    assert sorted(files) == sorted(p.name for p in OVERLAY.glob("*.yaml") if p.name != "kustomization.yaml")
    docs = {}
    for name in files:
        for doc in yaml.safe_load_all((OVERLAY / name).read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return kustomization, docs


KUSTOMIZATION, OVERLAY_DOCS = overlay()


def overlay_container(kind: str, name: str) -> dict[str, Any]:
    (only,) = OVERLAY_DOCS[(kind, name)]["spec"]["template"]["spec"]["containers"]
    return only


def redis_flags(container: dict[str, Any]) -> dict[str, str]:
    """The options of a redis-server started through `sh -c "exec redis-server ..."`."""
    words = shlex.split(container["command"][2])
    assert words[0] == "exec", words
    return redis_options(words[1:])


def password_env(container: dict[str, Any]) -> dict[str, Any]:
    (env,) = [e for e in container["env"] if e["name"] == "REDIS_PASSWORD"]
    return env["valueFrom"]["secretKeyRef"]


def test_the_bases_redis_becomes_a_primary_that_can_turn_replica() -> None:
    (patch,) = KUSTOMIZATION["patches"]
    doc = yaml.safe_load((OVERLAY / patch["path"]).read_text())
    target = (doc["kind"], doc["metadata"]["name"])
    assert target == ("Deployment", "renderfarm-redis") and target in DOCS
    patched, base = overlay_container(*target), container("renderfarm-redis")
    assert patched["name"] == base["name"]  # a strategic merge: the container matched by name
    flags, before = redis_flags(patched), redis_flags(base)
    assert {k: v for k, v in flags.items() if k in before} == before, "the base's flags are kept"
    assert flags["--masterauth"] == flags["--requirepass"] == "$REDIS_PASSWORD"
    assert flags["--replica-announce-ip"] == "renderfarm-redis" and ("Service", "renderfarm-redis") in DOCS


def test_the_replica_replicates_the_bases_redis_with_its_password() -> None:
    replica = overlay_container("Deployment", "renderfarm-redis-replica")
    flags = redis_flags(replica)
    (port,) = DOCS[("Service", "renderfarm-redis")]["spec"]["ports"]
    assert flags["--replicaof"] == f"renderfarm-redis {port['port']}"
    assert flags["--masterauth"] == flags["--requirepass"] == "$REDIS_PASSWORD"
    assert flags["--appendonly"] == "yes"
    assert password_env(replica) == password_env(container("renderfarm-redis"))
    service = OVERLAY_DOCS[("Service", "renderfarm-redis-replica")]["spec"]
    assert flags["--replica-announce-ip"] == "renderfarm-redis-replica"
    deployment = OVERLAY_DOCS[("Deployment", "renderfarm-redis-replica")]["spec"]
    assert service["selector"] == deployment["selector"]["matchLabels"]
    assert [p["targetPort"] for p in service["ports"]] == [p["name"] for p in replica["ports"]]
    (claim,) = deployment["template"]["spec"]["volumes"]
    assert ("PersistentVolumeClaim", claim["persistentVolumeClaim"]["claimName"]) in OVERLAY_DOCS


def sentinel_config() -> tuple[dict[str, Any], str]:
    sentinel = overlay_container("StatefulSet", "renderfarm-sentinel")
    assert sentinel["command"][:2] == ["sh", "-c"]
    return sentinel, heredoc(sentinel["command"][2])


def test_the_sentinels_monitor_the_primary_by_a_majority_and_the_broker_url_names_them() -> None:
    statefulset = OVERLAY_DOCS[("StatefulSet", "renderfarm-sentinel")]["spec"]
    headless = OVERLAY_DOCS[("Service", statefulset["serviceName"])]["spec"]
    assert headless["clusterIP"] == "None" and headless["selector"] == statefulset["selector"]["matchLabels"]
    sentinel, config = sentinel_config()
    lines = config.splitlines()
    (monitor,) = [line.split()[2:] for line in lines if line.startswith("sentinel monitor ")]
    name, host, port, quorum = monitor[0], monitor[1], int(monitor[2]), int(monitor[3])
    assert (host, port) == ("renderfarm-redis", 6379)
    assert statefulset["replicas"] // 2 < quorum <= statefulset["replicas"], "a majority of the sentinels"
    assert f"sentinel auth-pass {name} $REDIS_PASSWORD" in lines
    assert password_env(sentinel) == password_env(container("renderfarm-redis"))
    assert f"sentinel announce-ip $POD_NAME.{statefulset['serviceName']}" in lines
    (own,) = [int(line.split()[1]) for line in lines if line.startswith("port ")]
    assert [p["containerPort"] for p in sentinel["ports"]] == [own] and headless["ports"][0]["port"] == own
    # The Secret's broker URL, as README.md creates it, names every sentinel and the master.
    readme = (K8S / "README.md").read_text()
    (url,) = re.findall(r'broker-url="(sentinel://[^"]+)"', readme)
    sentinels = sentinels_of(url.replace("$PW", "pw"))
    assert sentinels is not None and (sentinels.master, sentinels.password) == (name, "pw")
    assert list(sentinels.hosts) == [(f"{statefulset['serviceName']}-{n}.{statefulset['serviceName']}", own)
                                     for n in range(statefulset["replicas"])]
    assert "kubectl apply -k infra/k8s/sentinel" in readme


def test_the_sentinel_configuration_starts_a_real_sentinel(tmp_path: Path) -> None:
    _, config = sentinel_config()
    config = config.replace("$POD_NAME", "renderfarm-sentinel-0").replace("$REDIS_PASSWORD", "pw")
    master = sentinel_master(config, "renderfarm-redis", tmp_path)
    assert (master["name"], master["quorum"], master["down-after-milliseconds"]) == ("renderfarm", 2, 5000)
