"""Argument checks shared by the package: each raises a `ValueError` that
names the argument, what was expected and what was received."""

import numbers

import keras


def check_int(value, name, minimum=1):
    """An int >= `minimum` (bools are refused)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < minimum
    ):
        raise ValueError(
            f"Expected `{name}` to be an int >= {minimum}. "
            f"Received: {name}={value!r}"
        )
    return int(value)


def check_fraction(value, name):
    """A number in [0, 1]; a `keras.Variable` passes as it is."""
    if isinstance(value, keras.Variable):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not 0.0 <= number <= 1.0:
        raise ValueError(
            f"Expected `{name}` to be a number in [0, 1]. "
            f"Received: {name}={value!r}"
        )
    return number


def check_positive(value, name):
    """A number > 0."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not number > 0:
        raise ValueError(
            f"Expected `{name}` to be a number > 0. Received: {name}={value!r}"
        )
    return number
