"""Argument checks shared by the losses, callbacks and training wrappers.

Each check returns the value it accepts (converted to a plain Python
number) and raises a `ValueError` that names the argument, what was
expected and what was received, as Keras does.
"""

import math
import numbers

import keras
import numpy as np


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(value, name, minimum=1, maximum=None):
    """Checks an integer argument in `[minimum, maximum]`.

    Args:
        value: the argument. Python and NumPy ints pass; bools and floats
            (even integral ones such as `2.0`) do not.
        name: the argument's name, for the error message.
        minimum: smallest value accepted, or `None` for no lower bound.
            Defaults to `1`.
        maximum: largest value accepted, or `None` for no upper bound.
            Defaults to `None`.

    Returns:
        `value` as a Python `int`.
    """
    if minimum is None and maximum is None:
        expected = "an int"
    elif maximum is None:
        expected = f"an int >= {minimum}"
    elif minimum is None:
        expected = f"an int <= {maximum}"
    else:
        expected = f"an int in [{minimum}, {maximum}]"
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(
            f"Expected `{name}` to be {expected}. Received: {name}={value!r}"
        )
    if (minimum is not None and value < minimum) or (
        maximum is not None and value > maximum
    ):
        raise ValueError(
            f"Expected `{name}` to be {expected}. Received: {name}={value!r}"
        )
    return int(value)


def check_fraction(value, name):
    """Checks a number in [0, 1]; a `keras.Variable` passes through as is.

    Variables are left alone so that a training loop can keep assigning
    them (a loss's `delta`); their value is not read.

    Args:
        value: the argument.
        name: the argument's name, for the error message.

    Returns:
        `value` as a Python `float`, or the variable itself.
    """
    if isinstance(value, keras.Variable):
        return value
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if not _is_number(value) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(
            f"Expected `{name}` to be a number in [0, 1]. "
            f"Received: {name}={value!r}"
        )
    return float(value)


def check_positive(value, name, allow_zero=False):
    """Checks a finite number > 0 (>= 0 with `allow_zero`).

    Args:
        value: the argument.
        name: the argument's name, for the error message.
        allow_zero: whether 0 passes. Defaults to `False`.

    Returns:
        `value` as a Python `float`.
    """
    bound = ">= 0" if allow_zero else "> 0"
    if (
        not _is_number(value)
        or not math.isfinite(float(value))
        or float(value) < 0.0
        or (float(value) == 0.0 and not allow_zero)
    ):
        raise ValueError(
            f"Expected `{name}` to be a finite number {bound}. "
            f"Received: {name}={value!r}"
        )
    return float(value)


def check_bool(value, name):
    """Checks a bool (Python's or NumPy's).

    Args:
        value: the argument.
        name: the argument's name, for the error message.

    Returns:
        `value` as a Python `bool`.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(
            f"Expected `{name}` to be True or False. Received: {name}={value!r}"
        )
    return bool(value)


def check_one_of(value, name, allowed):
    """Checks that `value` is one of `allowed`.

    Args:
        value: the argument.
        name: the argument's name, for the error message.
        allowed: a tuple of the accepted values.

    Returns:
        `value`, unchanged.
    """
    if value not in allowed:
        raise ValueError(
            f"Expected `{name}` to be one of {tuple(allowed)}. "
            f"Received: {name}={value!r}"
        )
    return value
