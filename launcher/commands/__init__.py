"""The commands, the top layer: ``python -m launcher`` (``cli``; its command line before Hydra: ``command_line``;
``--help``: ``help``), sweeps (``sweep``) and ``python -m launcher plot`` (``plot``)."""
