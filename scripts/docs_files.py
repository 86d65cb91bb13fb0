"""mkdocs hook (mkdocs.yml ``hooks``): the site is built from the repository's own Markdown at its own paths
(README.md as the home page, docs/*.md, bench/README.md with its figures, tests/README.md), so every relative link
and image works alike on GitHub and in the site, and nothing is copied or included twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("README.md", "docs/*.md", "bench/README.md", "bench/*.png", "tests/README.md")


def on_files(files: Files, config: Any) -> Files:
    for file in [f for f in files if Path(f.src_dir) == Path(config.docs_dir)]:
        files.remove(file)  # docs_dir's own view of docs/: its pages come back below at their repository paths
    for pattern in SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            files.append(File(str(path.relative_to(ROOT)), str(ROOT), config.site_dir, config.use_directory_urls))
    return files
