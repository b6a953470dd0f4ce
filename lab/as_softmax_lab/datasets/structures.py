"""Containers returned by the dataset loaders."""

import dataclasses
from typing import NamedTuple

import numpy as np

SPLITS = ("train", "validation", "test")


class TextSplit(NamedTuple):
    """One split of a (multi-class or multi-label) text classification set.

    Attributes:
        texts: list of `str`.
        labels: `np.ndarray`. For multi-class data an `int32` array of shape
            `(num_examples,)` with class ids; for multi-label data a multi-hot
            `float32` array of shape `(num_examples, num_classes)`.

    Being a named tuple, a split unpacks as `texts, labels = data.train`.
    """

    texts: list
    labels: np.ndarray

    def __repr__(self):
        return (
            f"TextSplit(num_examples={len(self.texts)}, "
            f"labels=<{self.labels.dtype} {self.labels.shape}>)"
        )


class TokenSplit(NamedTuple):
    """One split of a token classification (tagging) set.

    Attributes:
        tokens: list of sentences, each a list of `str` word tokens.
        tags: list of sentences, each a list of `int` tag ids, one per token.

    Being a named tuple, a split unpacks as `tokens, tags = data.train`.
    """

    tokens: list
    tags: list

    def __repr__(self):
        num_tokens = sum(len(t) for t in self.tokens)
        return (
            f"TokenSplit(num_sentences={len(self.tokens)}, "
            f"num_tokens={num_tokens})"
        )


@dataclasses.dataclass(frozen=True, repr=False)
class ClassificationData:
    """A text classification dataset with fixed splits.

    Attributes:
        name: str. The dataset's name, e.g. `"wordnet_lexname"`.
        train: `TextSplit`.
        validation: `TextSplit`.
        test: `TextSplit`.
        class_names: tuple of `str`; `class_names[i]` names class id `i`.
        multi_label: bool. Whether `labels` are multi-hot rows (multi-label)
            or integer class ids (multi-class).
    """

    name: str
    train: TextSplit
    validation: TextSplit
    test: TextSplit
    class_names: tuple
    multi_label: bool

    @property
    def num_classes(self):
        """Number of classes, `len(class_names)`."""
        return len(self.class_names)

    @property
    def splits(self):
        """Dict from split name to split."""
        return {name: getattr(self, name) for name in SPLITS}

    def __repr__(self):
        sizes = ", ".join(f"{n}={len(s.texts)}" for n, s in self.splits.items())
        return (
            f"ClassificationData(name={self.name!r}, "
            f"num_classes={self.num_classes}, "
            f"multi_label={self.multi_label}, {sizes})"
        )


@dataclasses.dataclass(frozen=True, repr=False)
class TokenClassificationData:
    """A token classification (tagging) dataset with fixed splits.

    Attributes:
        name: str. The dataset's name, e.g. `"wordnet_tokens"`.
        train: `TokenSplit`.
        validation: `TokenSplit`.
        test: `TokenSplit`.
        class_names: tuple of `str` tag names (`"O"`, `"B-..."`, `"I-..."`);
            `class_names[i]` names tag id `i`.
    """

    name: str
    train: TokenSplit
    validation: TokenSplit
    test: TokenSplit
    class_names: tuple

    @property
    def num_classes(self):
        """Number of tags, `len(class_names)`."""
        return len(self.class_names)

    @property
    def splits(self):
        """Dict from split name to split."""
        return {name: getattr(self, name) for name in SPLITS}

    def __repr__(self):
        sizes = ", ".join(
            f"{n}={len(s.tokens)}" for n, s in self.splits.items()
        )
        return (
            f"TokenClassificationData(name={self.name!r}, "
            f"num_classes={self.num_classes}, {sizes})"
        )


def multi_hot(label_lists, num_classes):
    """Turns lists of class ids into a `float32` multi-hot matrix."""
    out = np.zeros((len(label_lists), num_classes), dtype="float32")
    for row, labels in enumerate(label_lists):
        out[row, list(labels)] = 1.0
    return out


def normalize_max_examples(max_examples):
    """Returns a dict split name -> limit (or `None`) from `max_examples`."""
    if max_examples is None:
        return {name: None for name in SPLITS}
    if isinstance(max_examples, dict):
        unknown = set(max_examples) - set(SPLITS)
        if unknown:
            raise ValueError(
                "`max_examples` keys must be among "
                f"{SPLITS}. Received: max_examples={max_examples}"
            )
        limits = {name: max_examples.get(name) for name in SPLITS}
    elif isinstance(max_examples, (int, np.integer)) and not isinstance(
        max_examples, bool
    ):
        limits = {name: int(max_examples) for name in SPLITS}
    else:
        raise ValueError(
            "`max_examples` must be None, a non-negative int or a dict from "
            f"split name to int. Received: max_examples={max_examples!r}"
        )
    for limit in limits.values():
        if limit is not None and (
            not isinstance(limit, (int, np.integer)) or limit < 0
        ):
            raise ValueError(
                "`max_examples` limits must be non-negative ints. "
                f"Received: max_examples={max_examples!r}"
            )
    return limits
