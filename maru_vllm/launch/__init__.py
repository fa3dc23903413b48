"""Starting, watching and stopping the processes of a graph (used by tests, demo and graphs)."""

from maru_vllm.launch.ports import free_port, free_ports
from maru_vllm.launch.process import ManagedProcess, ProcessFailed, ProcessGroup

__all__ = ["ManagedProcess", "ProcessFailed", "ProcessGroup", "free_port", "free_ports"]
