"""``python -m launcher``: see ``launcher.commands.cli`` for the manual (``--help``: ``launcher.commands.help``,
without torch)."""

import sys

if __name__ == "__main__":
    if {"--help", "-h"} & set(sys.argv[1:]):
        from launcher.commands.help import main
    else:
        from launcher.commands.cli import main
    main()
