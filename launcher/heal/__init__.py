"""Healing in place: a lost machine's survivors go on in the same processes, and a machine that answers again
joins them, without a restart. One subsystem over three kinds of process, with one typed protocol:

    head (heal/head_side.py) ──stdin: LostWord, JoinWord──▶ keeper (heal/keeper.py) ──stdout: ROUND Decision──▶ head
                                                 │ hosts the job's store, decides rounds (heal/rounds.py)
    node process (heal/node_side.py) ──signed heartbeat, done──▶ store ◀──signed check-in, ready, Decision── ranks
                                                                                      (heal/rank_side.py: Healer)

A round's life, as a rank sees it (``Healer``)::

    training in round N ──a machine lost (the watch reads Decision N)──▶ abort tripped with it: PeerLost(Decision)
        └─▶ lost(exc): the Decision ──▶ enter_round: check in, form round N+1 on the keeper's store
              └─▶ agree_on_state (the ranks behind get the state from the one ahead) ──▶ training in round N+1
    training in round N ──a machine joins (Decision N grows)──▶ every rank leaves at the next step boundary (Grows)
        └─▶ enter_round as above, the new machine last

Reading map: ``protocol.py`` (the words: ``Decision``, ``Keys``, ``LostWord``/``JoinWord``, ``Place``), ``rounds.py``
(the keeper's rules, pure), ``keeper.py`` (the keeper process), ``head_side.py`` (``KeeperClient``: the head's
handle on the keeper), ``node_side.py`` (a node's ranks without an agent), ``rank_side.py`` (a rank's side). What
the rest of the launcher calls: ``config.rules.heals_in_place(job)``; ``head_side.KeeperClient`` (started by
``launch.nodes.attempts.run_attempt`` for sim and ssh; the head's wait, ``launch/nodes/waiting.py``, applies each
decision to the head's ``Membership``, ``launch/nodes/restarts.py``); ``node_side.run_workers``
(``launch/nodes/process.py``); and the trainer's ``rank_side.Healer``, through one seam
(``launcher.train.in_place.Healing``). A job's record of its changes of machines, ``membership.jsonl``, is no part
of this package (``base/membership.py``): a job that never heals writes it too.

Only the job's own processes speak in it: the head makes a fresh secret per job (``launcher.trust.secret``) and hands
it on without a command line; every key lives under the secret's namespace and every value the keeper, the node
processes and the ranks act on is signed (``launcher.trust.signed.SignedStore``); the state sent during a heal is a
signed pickle, refused before unpickling unless it verifies. The sync engine and the object collectives get the abort
signal handed in (``launcher.group.abort.Abort``): they import nothing of this package.
"""
