"""The configuration reference (docs/configuration-reference.md, issue 40) cannot go stale: it is what
``launcher.config.reference`` renders from the schemas; every key has a sentence; every key of the composed config
(each cluster kind, each model group) is on the page, and the page names no key that does not exist."""

import re

import pytest
from omegaconf import OmegaConf

from harness import REPO
from harness.config import compose
from launcher.config.reference import render

PAGE = REPO / "docs" / "configuration-reference.md"
LAYOUTS = [
    (),
    ("+cluster=sim",),
    ("+cluster=slurm",),
    ("+cluster=ssh",),
    ("model=mlp",),
    ("model=resnet18",),
    ("model=text_classifier",),
]


def keys(tree: object, prefix: str = "") -> list[str]:
    """Every leaf key of a composed config (``--cfg job``'s YAML as a dict), dotted."""
    if not isinstance(tree, dict) or not tree:
        return [prefix.rstrip(".")]
    return [k for name, sub in tree.items() for k in keys(sub, f"{prefix}{name}.")]


def page_keys(text: str) -> set[str]:
    return set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.MULTILINE))


def composed_keys(*overrides: str) -> set[str]:
    return set(keys(OmegaConf.to_container(compose(*overrides), resolve=False)))


def test_the_page_is_what_the_schemas_render():
    assert PAGE.read_text() == render(), (
        "docs/configuration-reference.md is stale; HINT: python -m launcher.config.reference > "
        "docs/configuration-reference.md"
    )


def test_every_key_has_a_type_a_default_and_a_sentence():
    rows = [line for line in render().splitlines() if line.startswith("| `")]
    assert len(rows) > 80
    empty = [row for row in rows if re.search(r"\|\s*\|$", row) or row.count("|") != 5]
    assert not empty, "keys without a sentence (a comment on their schema field):\n" + "\n".join(empty)


@pytest.mark.parametrize("overrides", LAYOUTS, ids=lambda o: " ".join(o) or "local")
def test_every_composed_key_is_on_the_page(overrides):
    missing = composed_keys(*overrides) - page_keys(render())
    assert not missing, f"keys of `python -m launcher {' '.join(overrides)} --cfg job` not in the reference: {missing}"


def test_the_page_names_only_real_keys():
    real = set().union(*(composed_keys(*o) for o in LAYOUTS))
    assert page_keys(render()) - real == set()
