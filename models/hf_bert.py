"""A real Hugging Face model for the trainer: ``transformers``' ``BertForSequenceClassification`` built from a small
``BertConfig`` (random weights, nothing downloaded, nothing cached). It takes the arguments of ``model=text_classifier``
(``models.text_classifier.TextClassifier``), so that group names it with the generated text data set::

    python -m launcher model=text_classifier model._target_=models.hf_bert.bert_classifier \\
        data=text_classification train.loss=model \\
        +train.metrics.f1._target_=torchmetrics.classification.MulticlassF1Score +train.metrics.f1.num_classes=2

A dict batch (``input_ids``, ``attention_mask``, ``labels``) calls ``model(**batch)``; under ``train.loss=model`` the
model gets ``labels`` and returns a ``SequenceClassifierOutput`` (a dict, and attributes) whose ``loss`` is the mean
cross-entropy over the batch (``num_classes >= 2`` and int64 labels: Hugging Face's ``single_label_classification``)
and whose ``logits`` the metrics score. ``token_type_ids`` may be left out (all zeros). Dropout is off by default, so
that a step is a function of the batch alone (2 ranks then train what one process trains on the whole batch).

``transformers`` is imported when the model is built, not with ``models`` (the import takes seconds); it comes with
the test extra (``pip install -e '.[test]'``) or ``pip install transformers``."""

from __future__ import annotations

from torch import nn

INSTALL = "pip install 'transformers>=4.40,<6' (or the project's test extra: pip install -e '.[test]')"


def bert_classifier(
    vocab_size: int = 64,
    num_classes: int = 2,
    d_model: int = 32,
    heads: int = 2,
    layers: int = 1,
    max_len: int = 64,
    dropout: float = 0.0,
) -> nn.Module:
    """A ``BertForSequenceClassification`` of ``layers`` encoder layers of width ``d_model`` (``heads`` heads, a
    feed-forward ``4 * d_model`` wide, ``dropout`` everywhere) over token ids in [0, ``vocab_size``) (0 the padding
    id) and sequences of at most ``max_len`` tokens; ``num_classes`` labels. About 18 K parameters with the
    defaults."""
    try:
        from transformers import BertConfig, BertForSequenceClassification
    except ImportError as exc:
        raise ImportError(f"models.hf_bert.bert_classifier needs transformers ({exc}); HINT: {INSTALL}") from exc
    if d_model % heads:
        raise ValueError(f"d_model={d_model} does not split into heads={heads}; HINT: a multiple of heads")
    if num_classes < 2:
        raise ValueError(f"num_classes={num_classes}: bert_classifier classifies (num_classes >= 2, int64 labels)")
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=d_model,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * d_model,
        max_position_embeddings=max_len,
        type_vocab_size=1,
        pad_token_id=0,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        classifier_dropout=dropout,
        problem_type="single_label_classification",  # the mean cross-entropy over the batch
    )
    config.num_labels = num_classes  # (a property: transformers 5's typed __init__ does not list it)
    return BertForSequenceClassification(config)
