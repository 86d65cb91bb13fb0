"""What a job reports: the failure records and the one report, root cause first (``failures``), how a rank's
traceback reads (``tracebacks``), and ``summary.json`` (``summary``). Torch-free: the heads read them."""
