"""The shared argument checks: every bad value is a ValueError naming it, never a TypeError from a comparison."""

import math
import re

import numpy as np
import pytest

from rank_lightning.validation import check_finite, check_fraction, check_non_negative, check_positive


@pytest.mark.parametrize("value", ["0.5", None, True, math.nan, 1.5, -0.1])
def test_a_fraction_is_a_finite_real_in_the_unit_interval(value):
    # A string reached "value >= 0" first and raised a TypeError instead of this message.
    with pytest.raises(ValueError, match=rf"label_smoothing must lie in \[0, 1\], got {value!r}"):
        check_fraction("label_smoothing", value, closed_low=True)


def test_the_finite_number_checks():
    for good in (0, 0.0, 2.5, np.float32(0.25)):
        check_non_negative("lambda_1", good)
        check_finite("threshold", -good)
    check_finite("threshold", None, allow_none=True)
    with pytest.raises(ValueError, match=r"lambda_1 must be a finite number >= 0, got -1"):
        check_non_negative("lambda_1", -1)
    with pytest.raises(ValueError, match=r"threshold must be a finite number or None, got inf"):
        check_finite("threshold", math.inf, allow_none=True)
    with pytest.raises(ValueError, match=r"tau must be a positive number, got True"):
        check_positive("tau", True)


def test_a_flag_is_a_bool_and_a_list_setting_a_collection():
    from rank_lightning.validation import check_bool, check_choices, check_names, check_non_negative_ints

    for good in (True, False, np.bool_(True)):
        check_bool("verbose", good)
    check_bool("cifar_stem", None, allow_none=True)
    for bad in ("no", "False", 1, 0, None, np.int64(1)):
        with pytest.raises(ValueError, match=rf"verbose must be True or False, got {re.escape(repr(bad))}"):
            check_bool("verbose", bad)
    # A number where a list belongs: the value named, not "'int' object is not iterable".
    with pytest.raises(ValueError, match=r"metrics must be a list of names, got 3; valid choices are: nc1, nc3"):
        check_choices("metrics", 3, ("nc1", "nc3"))
    with pytest.raises(ValueError, match=r"layers must be None or a non-empty list of non-empty strings, got 3"):
        check_names("layers", 3)
    assert check_non_negative_ints("classes", [0, np.int64(2)]) == (0, 2)
    with pytest.raises(ValueError, match=r"classes must be a non-empty list of non-negative integers, got \[-1\]"):
        check_non_negative_ints("classes", [-1])
