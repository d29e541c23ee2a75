"""SGLang mount: transfer backend `pdsdk` (`--disaggregation-transfer-backend pdsdk`) over any pdsdk
transport, and a HiCache storage backend over any pdsdk store (`--hicache-storage-backend dynamic`).

The `sglang.srt.plugins` entry point (`plugin.register`) wires the backend into SGLang; nothing
here is imported by `import pdsdk`. `command.py` builds SGLang worker command lines and needs no
SGLang at all.
"""
