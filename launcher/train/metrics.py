"""What a run leaves behind for people and tools: ``metrics.jsonl`` (one JSON object per logged step or
evaluation) and ``summary.json`` at the end. Only rank 0 writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, TextIO

from ..run_dir import RunDir


class MetricsWriter:
    """Appends JSON lines to ``run_dir/metrics.jsonl`` (a resumed run continues the same file)."""

    def __init__(self, run_dir: str | Path, enabled: bool) -> None:
        self.path = RunDir(run_dir).metrics
        self._file: Optional[TextIO] = None
        if enabled:
            self.open()

    def open(self) -> None:
        """Start writing (rank 0; a rank that became rank 0 when the job healed in place)."""
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
