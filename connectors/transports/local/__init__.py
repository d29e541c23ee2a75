"""`local`: the same-host transport (cross-memory attach on the host, CUDA IPC on GPUs); see transport.py."""
