"""The configuration reference (docs/configuration-reference.md, issue 40) cannot go stale: it is what
``launcher.config.reference`` renders from the schemas; every key has a sentence that is not a placeholder (issue 51);
every key of the composed config (each cluster kind, each model group) is on the page, and the page names no key that
does not exist."""

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


# words that carry no meaning of their own: a sentence made of these and the key's own name says nothing
FILLER = {"a", "an", "the", "of", "for", "to", "in", "on", "is", "it", "this", "that", "value", "key", "setting"}
PLACEHOLDER = re.compile(r"\b(todo|tbd|fixme|xxx|placeholder|lorem|undocumented)\b|^\W*$|\?\?", re.IGNORECASE)


def placeholder(key: str, sentence: str) -> str:
    """Why ``sentence`` says nothing about ``key`` ("" when it does): empty, a marker (TODO, ...), under 3 words,
    or nothing but the key's own name and filler words."""
    words = re.findall(r"[a-z0-9]+", sentence.replace("\\_", "_").lower())
    named = set(re.findall(r"[a-z0-9]+", key.lower()))
    if PLACEHOLDER.search(sentence):
        return "empty or a placeholder marker"
    if len(words) < 3:
        return f"{len(words)} word(s)"
    if set(words) <= named | FILLER:
        return "the key's own name again"
    return ""


def test_every_key_has_a_type_a_default_and_a_sentence():
    """Each row's sentence (its schema field's comment) says something: not empty, no TODO, 3 words at least, more
    than the key's name (issue 51: "any text" passed before)."""
    rows = [line for line in render().splitlines() if line.startswith("| `")]
    assert len(rows) > 80
    broken = [row for row in rows if row.count("|") != 5]
    assert not broken, "rows that are not key | type | default | sentence:\n" + "\n".join(broken)
    said = {row.split("|")[1].strip(" `"): row.split("|")[4].strip() for row in rows}
    bad = {key: why for key, sentence in said.items() if (why := placeholder(key, sentence))}
    assert not bad, f"keys without a real sentence (a comment on their schema field): {bad}"


@pytest.mark.parametrize(
    ("key", "sentence"),
    [
        ("train.seed", ""),
        ("train.seed", "TODO"),
        ("train.seed", "seed"),
        ("data.train_samples", "synthetic"),
        ("data.train_samples", "the train samples"),
        ("comm.trace_steps", "trace steps value"),
        ("optim.lr", "lr: ??"),
    ],
)
def test_a_placeholder_sentence_is_caught(key, sentence):
    assert placeholder(key, sentence), sentence


def test_a_real_sentence_passes():
    assert placeholder("data.train_samples", "synthetic: how many training samples it generates") == ""
    assert placeholder("optim.momentum", "sgd's momentum (adamw has none: ignored there)") == ""


@pytest.mark.parametrize("overrides", LAYOUTS, ids=lambda o: " ".join(o) or "local")
def test_every_composed_key_is_on_the_page(overrides):
    missing = composed_keys(*overrides) - page_keys(render())
    assert not missing, f"keys of `python -m launcher {' '.join(overrides)} --cfg job` not in the reference: {missing}"


def test_the_page_names_only_real_keys():
    real = set().union(*(composed_keys(*o) for o in LAYOUTS))
    assert page_keys(render()) - real == set()
