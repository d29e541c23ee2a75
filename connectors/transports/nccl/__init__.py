"""`nccl`: torch.distributed pair groups between peers that meet at run time; see transport.py."""
