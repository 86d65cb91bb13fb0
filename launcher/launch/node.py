"""One simulated node's elastic agent: ``python -m launcher.launch.node RUN_DIR NNODES NODE ENDPOINT RUN_ID ADDR``.

Started by the sim launcher, once per virtual node (inside the node's network namespace when there is one).
"""

from __future__ import annotations

import sys

from ..config import load_frozen
from .agent import agent_config, run_agent


def main(argv: list[str]) -> int:
    run_dir, nnodes, node, endpoint, run_id, addr = argv
    job = load_frozen(run_dir)
    config = agent_config(job, int(nnodes), endpoint, run_id, is_host=node == "0", local_addr=addr, node=int(node))
    return run_agent(job, config, node=int(node), report=False)  # the sim launcher reports once for all nodes


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
