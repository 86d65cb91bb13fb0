"""``python -m launcher``: see ``launcher.cli`` for the manual."""

from launcher.cli import main

if __name__ == "__main__":
    main()
