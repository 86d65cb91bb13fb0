"""The commands, the top layer: ``python -m launcher`` (``cli``; its command line before Hydra: ``command_line``;
``--help``: ``help``; ``dry_run=true``: ``dry_run``; a console pipe closed under it: ``pipes``), sweeps (``sweep``),
``python -m launcher plot`` (``plot``) and ``python -m launcher export`` (``export``: the model alone)."""
