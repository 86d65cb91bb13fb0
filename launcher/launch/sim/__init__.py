"""``+cluster=sim``: simulated nodes on this host (``head``), optionally each in its own network namespace with a
shaped link (``netns``)."""
