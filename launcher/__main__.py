"""``python -m launcher``: see ``launcher.cli`` for the manual (``--help``: ``launcher.help``, without torch)."""

import sys

if __name__ == "__main__":
    if {"--help", "-h"} & set(sys.argv[1:]):
        from launcher.help import main
    else:
        from launcher.cli import main
    main()
