"""Node processes: torch's elastic agent for one node's ranks (``agent``: the local mode runs one here, each node
process of the sim and ssh heads one on its node), one node's process (``process``: that agent, or a healing job's
ranks) and the head's side of node processes (``control``: their command line, control words, stop forwarding,
exit codes)."""
