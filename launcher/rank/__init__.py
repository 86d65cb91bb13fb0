"""A rank's life: its process's entry (``entry.rank_main``), what it does (``work``: the trainer, the doctor or a
user's script), a script's stop signals (``script_stop``) and the doctor's checks (``doctor``)."""
