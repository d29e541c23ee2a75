"""pdsdk.ports: ports picked for servers that start later, and the check made before starting one."""

import socket

import pytest
from helpers import run_cli

from pdsdk import ConfigError
from pdsdk.ports import HIGHEST, bindable, ephemeral_range, free_port, require_free


def test_free_ports_are_outside_the_ephemeral_range_and_never_repeat():
    lo, hi = ephemeral_range()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    # the kernel gives ephemeral ports to bind(0) and outgoing connections: an engine's own sockets
    # can take one between the pick and the server's start, never one of these
    assert not [p for p in ports if lo <= p <= hi]
    assert max(ports) <= HIGHEST == 55535  # SGLang's gRPC port is --port + 10000: a GPU run found it


def test_an_ephemeral_range_that_leaves_no_room_is_named(monkeypatch):
    from pdsdk import ports

    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    with pytest.raises(OSError, match="ip_local_port_range"):
        free_port()


def test_a_held_port_is_named_with_its_flag():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not bindable("127.0.0.1", port, reuse=True)
        with pytest.raises(ConfigError, match=rf"--port: port {port} on 127.0.0.1 is in use"):
            require_free("127.0.0.1", port, "--port")


def test_a_closed_servers_time_wait_does_not_block_a_restart_on_its_port():
    # a router stopped and started again on --port 8000: its closed connections linger in TIME_WAIT
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's and uvicorn's servers
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
        conn.close()  # the server side closes first: its end goes to TIME_WAIT
        client.recv(1)
        client.close()
    assert not bindable("127.0.0.1", port)  # strict: free_port never picks such a port
    require_free("127.0.0.1", port, "--port")  # but a server with SO_REUSEADDR binds it


@pytest.mark.slow  # a few seconds of subprocesses: the full suite
def test_router_and_launch_name_a_taken_port_before_starting_anything():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = str(s.getsockname()[1])
        router = run_cli("router", "--worker", "http://127.0.0.1:9", "--port", port)
        assert router.returncode == 2 and f"--port: cannot listen on 127.0.0.1:{port}" in router.stderr
        launch = run_cli("launch", "--engine", "vllm", "--model", "/m/tiny", "--transport", "nixl", "--port", port)
        assert launch.returncode == 2 and f"--port: port {port} on 127.0.0.1 is in use" in launch.stderr
        assert "prefill-0" not in launch.stdout  # no engine was started
