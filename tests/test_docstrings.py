"""The `Example:` sections of the docstrings run and print what they say."""

import doctest
import importlib

import pytest

MODULES = [
    "keras_as_softmax.losses.as_softmax",
    "keras_as_softmax.losses.multilabel",
    "keras_as_softmax.losses.baselines",
    "keras_as_softmax.metrics",
    "as_softmax_lab.task_metrics",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(
        importlib.import_module(name), optionflags=doctest.ELLIPSIS
    )
    assert result.attempted > 0 and result.failed == 0
