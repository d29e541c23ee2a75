"""One serving process of `pdsdk router --processes N`, started by parent.py:
python -m pdsdk.router.processes.child STATE_DIR INDEX PARENT_PID LOG_LEVEL < CONFIG_JSON
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

import msgspec

from pdsdk.router.config import RouterConfig

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """SIGTERM (a drain) when the parent dies, however it dies: no serving process outlives it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (AttributeError, OSError):  # not Linux
        return
    if os.getppid() != parent:  # it died before the line above
        sys.exit(1)


def main(argv: list[str]) -> None:
    state_dir, index, parent, level = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    _die_with_parent(parent)
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s %(name)s [process {index}]: %(message)s")
    cfg = msgspec.json.decode(sys.stdin.buffer.read(), type=RouterConfig)
    from pdsdk.router.processes.link import Link
    from pdsdk.router.processes.load_table import LoadTable
    from pdsdk.router.server import run

    run(cfg, link=Link(state_dir, index, LoadTable(os.path.join(state_dir, "load"), cfg.processes, index)))


if __name__ == "__main__":
    main(sys.argv[1:])
