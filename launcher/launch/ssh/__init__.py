"""``+cluster=ssh``: one node process per machine over ssh, from one head (``head``): the hosts and their slots
(``hosts``), the checks each passes first (``host_check``, run on that host), the head's ssh clients (``clients``)
and a job that heals in place (``healing``)."""
