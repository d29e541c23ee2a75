"""`pdsdk launch`: plans, --dry-run, --emit k8s (validated against the Kubernetes API schema)."""

import json
import os
import shlex

import pytest
import yaml
from helpers import run_cli

from pdsdk import ConfigError
from pdsdk.launch.plan import LaunchOptions, build_plan


def test_plan_assigns_roles_ports_and_cores():
    plan = build_plan(LaunchOptions(engine="vllm", model="/m/tiny", transport="nixl", prefill=1, decode=2))
    assert [w.name for w in plan.workers] == ["prefill-0", "decode-0", "decode-1"]
    assert len({w.port for w in plan.workers} | {plan.router.port}) == 4
    assert all("VLLM_CPU_OMP_THREADS_BIND" in w.env for w in plan.workers)
    kv = json.loads(plan.workers[0].cmd[plan.workers[0].cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_producer" and kv["kv_connector_extra_config"]["transport"] == "nixl"
    assert plan.router.cmd.count("--decode") == 2 and plan.router.cmd.count("--prefill") == 1
    assert "--processes" not in plan.router.cmd  # the router's own default


def test_router_processes_pass_through_to_the_router():
    plan = build_plan(LaunchOptions(engine="vllm", model="/m/tiny", router_processes=3))
    assert plan.router.cmd[plan.router.cmd.index("--processes") + 1] == "3"
    with pytest.raises(ConfigError, match="--router-processes"):
        build_plan(LaunchOptions(engine="vllm", model="/m/tiny", router_processes=0))


def test_on_cpu_prefill_and_decode_workers_get_cores_of_their_own(monkeypatch):
    from pdsdk.launch.plan import placements

    def binds(cores, roles):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(cores))
        return [p["VLLM_CPU_OMP_THREADS_BIND"] for p in placements(len(roles), 1, None, roles)]

    # a decode worker polls its transfer without pause: never on the core of the prefill it reads from
    assert binds([0, 1], ["prefill", "decode", "decode"]) == ["0", "1", "1"]
    assert binds([0, 1], ["prefill", "prefill", "decode"]) == ["0", "0", "1"]
    assert binds([0, 1, 2, 3], ["prefill", "decode"]) == ["0-1", "2-3"]
    assert binds([0, 1], ["worker", "worker"]) == ["0", "1"] and binds([0], ["prefill", "decode"]) == ["0", "0"]


def test_gpus_are_split_per_worker_by_tp():
    plan = build_plan(LaunchOptions(engine="vllm", model="m", prefill=1, decode=1, tp=2, gpus=[0, 1, 2, 3]))
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in plan.workers] == ["0,1", "2,3"]
    with pytest.raises(ConfigError, match="--gpus.*need 4 GPU ids, got 2"):
        build_plan(LaunchOptions(engine="vllm", model="m", tp=2, gpus=[0, 1]))


def test_a_gpu_given_twice_is_shared_with_part_of_its_memory_and_staggered_starts():
    plan = build_plan(LaunchOptions(engine="vllm", model="m", prefill=2, decode=1, gpus=[0, 0, 1]))
    p0, p1, d = plan.workers
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in plan.workers] == ["0", "0", "1"]
    for w in (p0, p1):
        assert w.cmd[w.cmd.index("--gpu-memory-utilization") + 1] == "0.42"
    assert "--gpu-memory-utilization" not in d.cmd  # alone on its GPU: the engine's default
    assert [[w.name for w in wave] for wave in plan.waves] == [["prefill-0", "decode-0"], ["prefill-1"]]

    mine = build_plan(LaunchOptions(engine="sglang", model="m", prefill=1, decode=1, gpus=[0, 0],
                                    engine_args=["--mem-fraction-static=0.3"]))
    assert all("--mem-fraction-static" not in w.cmd and "--mem-fraction-static=0.3" in w.cmd for w in mine.workers)
    # Overlapping TP groups: the decode on GPU 1 waits for the TP=2 prefill on GPUs 0,1.
    hetero = build_plan(LaunchOptions(engine="vllm", model="m", prefill_tp=2, worker_gpus=[[0, 1], [1]]))
    assert [[w.name for w in wave] for wave in hetero.waves] == [["prefill-0"], ["decode-0"]]


def test_bad_parts_fail_before_anything_starts():
    with pytest.raises(ConfigError, match="unknown transport 'pigeon'"):
        build_plan(LaunchOptions(engine="vllm", model="m", transport="pigeon"))
    with pytest.raises(ConfigError, match="--engine"):
        build_plan(LaunchOptions(engine="tgi", model="m"))


def test_plain_mode_has_no_connector():
    plan = build_plan(LaunchOptions(engine="vllm", model="m", prefill=0, decode=2))
    assert all("--kv-transfer-config" not in w.cmd for w in plan.workers)
    assert plan.router.cmd.count("--worker") == 2


def test_plain_workers_with_a_store_get_the_connector_for_it_alone():
    plan = build_plan(LaunchOptions(engine="vllm", model="/m", prefill=0, decode=2, store="memory"))
    for w in plan.workers:
        kv = json.loads(w.cmd[w.cmd.index("--kv-transfer-config") + 1])
        assert kv["kv_role"] == "kv_both"
        assert kv["kv_connector_extra_config"]["transport"] is None
        assert kv["kv_connector_extra_config"]["store"] == "memory"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_kv_events_policy_wires_each_worker_event_stream_to_the_router(engine):
    """--policy kv_events: every worker publishes on its own local sockets (ipc://, bound by the
    engines' publishers), the router is told each worker's endpoints, and nothing else changes."""
    plan = build_plan(LaunchOptions(engine=engine, model="/m", prefill=1, decode=2, policy="kv_events"))
    router = plan.router.cmd
    assert plan.ipc_dir and len(plan.ipc_dir) < 60 and router[router.index("--policy") + 1] == "kv_events"
    for w in plan.workers:
        cfg = json.loads(w.cmd[w.cmd.index("--kv-events-config") + 1])
        assert cfg["publisher"] == "zmq" and cfg.get("enable_kv_cache_events") is (True if engine == "vllm" else None)
        assert (cfg["endpoint"], cfg["replay_endpoint"]) == w.kv_events
        assert all(e.startswith(f"ipc://{plan.ipc_dir}/{w.name}.") for e in w.kv_events)
        assert f"{w.url}={w.kv_events[0]}" in router and f"{w.url}={w.kv_events[1]}" in router
    assert router.count("--kv-events") == router.count("--kv-replay") == 3
    plain = build_plan(LaunchOptions(engine=engine, model="/m", prefill=1, decode=2))
    assert plain.ipc_dir is None and all("--kv-events-config" not in w.cmd for w in plain.workers)
    with pytest.raises(ConfigError, match="kv-events-config"):
        build_plan(LaunchOptions(engine=engine, model="/m", policy="kv_events",
                                 engine_args=["--kv-events-config", "{}"]))


def test_kv_events_sockets_live_in_a_private_folder_for_the_launch(tmp_path):
    from pdsdk.launch.supervisor import Supervisor

    plan = build_plan(LaunchOptions(engine="vllm", model="/m", prefill=0, decode=1, policy="kv_events"))
    sup = Supervisor(plan, tmp_path, echo=False)
    try:
        assert os.path.isdir(plan.ipc_dir) and os.stat(plan.ipc_dir).st_mode & 0o777 == 0o700
    finally:
        sup.stop()
    assert not os.path.exists(plan.ipc_dir)


def test_dry_run_prints_commands_and_env_and_starts_nothing():
    out = run_cli("launch", "--engine", "vllm", "--model", "/m/tiny", "--transport", "mooncake", "--dry-run",
                  "--", "--max-model-len", "512")
    assert out.returncode == 0, out.stderr
    commands = [line for line in out.stdout.splitlines() if "python" in line]
    assert len(commands) == 3
    for line in commands[:2]:
        argv = shlex.split(line)
        assert "--max-model-len" in argv and "512" in argv
        assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]["transport"] \
            == "mooncake"
    assert "VLLM_CPU_OMP_THREADS_BIND=" in out.stdout


def test_emit_k8s_is_schema_valid_and_round_trips_the_parts(tmp_path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    store = json.dumps({"tiered": ["memory", "disk"]})
    out = run_cli("launch", "--engine", "vllm", "--model", "/models/qwen", "--transport", "nixl", "--store", store,
                  "--prefill", "2", "--decode", "3", "--tp", "2", "--gpus", "0,1,2,3,4,5,6,7,8,9",
                  "--unhealthy-timeout", "30", "--start-timeout", "600", "--router-processes", "4",
                  "--emit", "k8s", str(tmp_path))
    assert out.returncode == 0, out.stderr
    objects = {p.name: yaml.safe_load(p.read_text()) for p in tmp_path.glob("*.yaml")}
    for obj in objects.values():
        kubernetes_validate.validate(obj, desired_version="1.30", strict=True)
    config = json.loads(objects["pdsdk-config-configmap.yaml"]["data"]["pdsdk.json"])
    assert config["transport"] == "nixl" and config["store"] == {"tiered": ["memory", "disk"]}
    prefill = objects["pdsdk-prefill-deployment.yaml"]["spec"]
    decode = objects["pdsdk-decode-deployment.yaml"]["spec"]
    assert prefill["replicas"] == 2 and decode["replicas"] == 3
    container = prefill["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    # the launcher's restarts in Kubernetes terms: 600 s to start, restarted after failing /health for 30 s
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] == 600
    live = container["livenessProbe"]
    assert live["httpGet"]["path"] == "/health" and live["periodSeconds"] * live["failureThreshold"] == 30
    assert prefill["template"]["spec"]["restartPolicy"] == "Always"
    router_pod = objects["pdsdk-router-deployment.yaml"]["spec"]["template"]["spec"]
    assert router_pod["containers"][0]["livenessProbe"]["httpGet"]["path"] == "/live"  # alive, workers or not
    assert router_pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"
    kv = json.loads(container["args"][container["args"].index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_producer" and kv["kv_connector_extra_config"]["store"] == config["store"]
    router = objects["pdsdk-router-deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "http://pdsdk-prefill:8000" in router and "http://pdsdk-decode:8000" in router
    # the router's processes follow its pod's CPU request
    router = router_pod["containers"][0]
    assert router["resources"]["requests"]["cpu"] == "4"
    env = {e["name"]: e.get("valueFrom") for e in router["env"]}
    assert env["PDSDK_ROUTER_PROCESSES"]["resourceFieldRef"]["resource"] == "requests.cpu"


@pytest.mark.slow  # a few seconds of subprocesses: the full suite
def test_emit_k8s_refuses_kv_events_and_restart_never_naming_the_option(tmp_path):
    out = run_cli("launch", "--engine", "vllm", "--model", "/m", "--policy", "kv_events", "--emit", "k8s", str(tmp_path))
    assert out.returncode != 0 and "--policy" in out.stderr + out.stdout and "kv_events" in out.stderr + out.stdout
    out = run_cli("launch", "--engine", "vllm", "--model", "/m", "--restart", "never", "--emit", "k8s", str(tmp_path))
    assert out.returncode != 0 and "--restart never" in out.stderr + out.stdout
    assert not list(tmp_path.glob("*.yaml"))


@pytest.mark.slow  # a CLI process each: the full suite only (make test-fast stays under 2 min)
@pytest.mark.parametrize("engine,needs", [("sglang", "GPU"), ("vllm", "vLLM")])
def test_a_missing_engine_is_named_before_anything_starts(engine, needs, tmp_path):
    """The reproduction: `pdsdk launch --engine sglang` without SGLang started processes, then
    failed with a ModuleNotFoundError from a worker's log."""
    import subprocess
    import sys

    blocked = (f"import sys; sys.modules[{engine!r}] = None; from pdsdk.cli import main; "  # as if not installed
               f"sys.exit(main(['launch', '--engine', {engine!r}, '--model', '/m/tiny', '--prefill', '1', "
               f"'--log-dir', {str(tmp_path / 'logs')!r}, '--start-timeout', '5', '--quiet']))")
    out = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 2, out.stdout + out.stderr
    assert f'pip install "pdsdk[{engine}]"' in out.stderr and needs in out.stderr, out.stderr
    assert not (tmp_path / "logs").exists()  # nothing was started
