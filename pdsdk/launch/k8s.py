"""`pdsdk launch --emit k8s DIR`: the same deployment as Kubernetes manifests.

A ConfigMap holds the pdsdk config; prefill and decode are Deployments with their own replica
counts, GPU requests and probes; the router is a Deployment behind a Service. Workers are reached
through their Services (per-pod routing needs etcd discovery: docs/launch.md). What the launcher's
restarts do, the kubelet does: a startup probe gives a worker --start-timeout to load, a liveness
probe restarts a container failing its health for --unhealthy-timeout (restartPolicy Always), and a
readiness probe takes a pod out of its Service while it cannot serve.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from pdsdk.errors import ConfigError
from pdsdk.launch.plan import LaunchOptions, LaunchPlan
from pdsdk.launch.restart import RestartPolicy

WORKER_PORT = 8000
ROUTER_PORT = 8000
LABEL = "app.kubernetes.io/part-of"
PROBE_PERIOD_S = 10
ROUTER_CPUS = 2  # the router pod's CPU request when --router-processes is not given


def manifests(plan: LaunchPlan, opts: LaunchOptions, image: str, router_image: str,
              restart: RestartPolicy | None = None) -> list[dict[str, Any]]:
    restart = restart or RestartPolicy()
    if restart.mode == "never":
        raise ConfigError("--restart", "a Deployment's pods are always restarted (restartPolicy: Always); "
                                       "--restart never has no Kubernetes form")
    if plan.ipc_dir:
        raise ConfigError("--policy", "kv_events reads each worker's own event stream, and these manifests put "
                                      "a role's replicas behind one Service; use prefix (or least_load) here, or "
                                      "register workers with their kv_events endpoints through the admin API")
    name = "pdsdk"
    out: list[dict[str, Any]] = [{
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-config", "labels": {LABEL: name}},
        "data": {"pdsdk.json": json.dumps(plan.config, indent=2)},
    }]
    roles = {w.role: w for w in plan.workers}
    counts = {"prefill": opts.prefill, "decode": opts.decode, "worker": opts.decode}
    for role, spec in roles.items():
        args = _container_args(spec.cmd, WORKER_PORT)
        out.append(_deployment(f"{name}-{role}", role, counts[role], image, args, WORKER_PORT,
                               gpus=opts.tp if opts.gpus else 0, config=True,
                               probes=_probes("/health", "/health", WORKER_PORT, restart)))
        out.append(_service(f"{name}-{role}", role, WORKER_PORT))
    router_args = ["pdsdk", "router", "--engine", opts.engine, "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
                   "--policy", opts.policy]
    for role, flag in (("prefill", "--prefill"), ("decode", "--decode"), ("worker", "--worker")):
        if role in roles:
            router_args += [flag, f"http://{name}-{role}:{WORKER_PORT}"]
    router = _deployment(f"{name}-router", "router", 1, router_image, router_args, ROUTER_PORT, gpus=0, config=False,
                         probes=_probes("/live", "/health", ROUTER_PORT, restart))
    _router_cpus(router, opts.router_processes or ROUTER_CPUS)
    out.append(router)
    out.append(_service(f"{name}-router", "router", ROUTER_PORT))
    return out


def write(objects: list[dict[str, Any]], directory: str | Path) -> list[Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for obj in objects:
        path = directory / f"{obj['metadata']['name']}-{obj['kind'].lower()}.yaml"
        path.write_text(yaml.safe_dump(obj, sort_keys=False))
        paths.append(path)
    return paths


def _container_args(cmd: list[str], port: int) -> list[str]:
    """The worker's command line inside the pod: `python` from the image, the pod's port and host."""
    args = ["python3", *[a for a in cmd[1:] if a != "-P"]]
    for flag, value in (("--port", str(port)), ("--host", "0.0.0.0")):
        if flag in args:
            args[args.index(flag) + 1] = value
    return args


def _probes(live: str, ready: str, port: int, restart: RestartPolicy) -> dict[str, Any]:
    """Startup (the first load may take --start-timeout), liveness (restart after failing health for
    --unhealthy-timeout) and readiness (out of the Service while it cannot serve)."""
    def get(path: str, **kw: int) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": port}, "timeoutSeconds": 5, **kw}
    return {"startupProbe": get(live, periodSeconds=PROBE_PERIOD_S,
                                failureThreshold=math.ceil(restart.start_timeout_s / PROBE_PERIOD_S)),
            "livenessProbe": get(live, periodSeconds=PROBE_PERIOD_S,
                                 failureThreshold=max(1, math.ceil(restart.unhealthy_s / PROBE_PERIOD_S))),
            "readinessProbe": get(ready, periodSeconds=5, failureThreshold=3)}


def _deployment(name: str, role: str, replicas: int, image: str, args: list[str], port: int, gpus: int,
                config: bool, probes: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": role, "image": image, "command": args[:1], "args": args[1:],
        "ports": [{"containerPort": port, "name": "http"}], **probes,
        "env": [{"name": "PDSDK_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}}
    pod: dict[str, Any] = {"restartPolicy": "Always", "containers": [container]}
    if config:  # SGLang workers read it through PDSDK_CONFIG; vLLM's carry it in --kv-transfer-config too
        container["env"].append({"name": "PDSDK_CONFIG", "value": "@/etc/pdsdk/pdsdk.json"})
        container["volumeMounts"] = [{"name": "pdsdk-config", "mountPath": "/etc/pdsdk"}]
        pod["volumes"] = [{"name": "pdsdk-config", "configMap": {"name": "pdsdk-config"}}]
    labels = {LABEL: "pdsdk", "app.kubernetes.io/component": role}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": pod}}}


def _router_cpus(deployment: dict[str, Any], cpus: int) -> None:
    """Request `cpus` for the router pod; its processes (PDSDK_ROUTER_PROCESSES) follow the request."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["resources"] = {"requests": {"cpu": str(cpus)}}
    container["env"].append({"name": "PDSDK_ROUTER_PROCESSES", "valueFrom": {"resourceFieldRef": {
        "containerName": container["name"], "resource": "requests.cpu", "divisor": "1"}}})


def _service(name: str, role: str, port: int) -> dict[str, Any]:
    labels = {LABEL: "pdsdk", "app.kubernetes.io/component": role}
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
            "spec": {"selector": labels, "ports": [{"port": port, "targetPort": port, "name": "http"}]}}
