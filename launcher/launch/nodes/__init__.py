"""Node processes and the head's one attempt loop over them: torch's elastic agent for one node's ranks (``agent``:
the local mode runs one here, each node process of the sim and ssh heads one on its node), one node's process
(``process``: that agent, or a healing job's ranks), the head's side of node processes (``control``: their command
line, control words, the ``Node`` handle, stop forwarding), the attempts of every several-node head (``attempts``:
the ``Machines`` a mode supplies, one attempt, the restarts) and its wait for one attempt (``waiting``)."""
