"""Ports handed to services that bind them later stay out of the kernel's ephemeral range, so an
outgoing connection cannot take one before its service binds it (an engine core's late bind would
otherwise fail with EADDRINUSE)."""

from __future__ import annotations

import socket

from maru_vllm.launch import stack
from maru_vllm.launch.ports import ephemeral_port_range, free_ports, free_system_port


def test_chosen_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    low, _ = ephemeral_port_range()
    ports = free_ports(20)
    assert len(set(ports)) == 20
    assert all(p < min(low, 32768) for p in ports), ports
    assert free_system_port() < 32768  # Dynamo parses DYN_SYSTEM_PORT as an i16
    for port in ports[:3]:  # a wildcard bind (what vLLM's publisher does) succeeds on each
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("0.0.0.0", port))


def test_outgoing_connections_never_get_a_chosen_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        clients = [socket.create_connection(server.getsockname()) for _ in range(50)]
        try:
            local_ports = {c.getsockname()[1] for c in clients}
        finally:
            for c in clients:
                c.close()
    assert max(free_ports(50)) < min(local_ports)


def test_each_engine_environment_gets_its_own_vllm_port_base(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("VLLM_PORT", raising=False)
    env = stack.StackEnv(discovery_dir=tmp_path)
    first, second = env.build(cpu_thread=0)["VLLM_PORT"], env.build(cpu_thread=1)["VLLM_PORT"]
    assert int(first) < ephemeral_port_range()[0] and int(second) < ephemeral_port_range()[0]
    monkeypatch.setenv("VLLM_PORT", "23456")  # an operator's choice wins
    assert env.build()["VLLM_PORT"] == "23456"
