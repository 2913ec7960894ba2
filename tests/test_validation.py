"""engine.validation: one message shape for every bad argument, bool refused as a number."""

from __future__ import annotations

import math

import pytest

from engine.validation import (boolean, divides, fraction, non_negative_int, one_of,
                               positive_int, positive_number)


@pytest.mark.parametrize("check, value, message", [
    (positive_int, 0, "x must be a positive int, got 0"),
    (positive_int, True, "x must be a positive int, got True"),
    (positive_int, 2.0, "x must be a positive int, got 2.0"),
    (non_negative_int, -1, "x must be an int >= 0, got -1"),
    (non_negative_int, False, "x must be an int >= 0, got False"),
    (positive_number, 0, "x must be a positive number, got 0"),
    (positive_number, True, "x must be a positive number, got True"),
    (positive_number, math.inf, "x must be a positive number, got inf"),
    (positive_number, "1", "x must be a positive number, got '1'"),
    (fraction, 1.5, "x must be a number in \\(0, 1\\], got 1.5"),
    (fraction, 0, "x must be a number in \\(0, 1\\], got 0"),
    (boolean, 1, "x must be True or False, got 1"),
    (boolean, "yes", "x must be True or False, got 'yes'"),
])
def test_each_check_names_the_argument_and_the_value(check, value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        check("x", value)


def test_good_values_come_back_unchanged():
    assert positive_int("x", 3) == 3
    assert non_negative_int("x", 0) == 0
    assert positive_number("x", 0.5) == 0.5
    assert fraction("x", 1) == 1 and fraction("x", 0, open_low=False) == 0
    assert one_of("x", "b", ("a", "b")) == "b"
    assert boolean("x", False) is False
    divides("t", 4, "heads", 8)


def test_one_of_and_divides_say_what_was_expected():
    with pytest.raises(ValueError, match="x must be one of 'a', 'b'; got 'c'"):
        one_of("x", "c", ("a", "b"))
    with pytest.raises(ValueError, match="x must be one of 0, 1; got True"):
        one_of("x", True, (0, 1))
    with pytest.raises(ValueError, match=r"t = 3 must divide heads = 8 \(8 % 3 = 2\)"):
        divides("t", 3, "heads", 8)


def test_the_trainer_refuses_a_bool_degree_before_any_rank_starts():
    from engine.train.cli import TrainConfig, check_config

    with pytest.raises(ValueError, match="--dp must be a positive int, got True"):
        check_config(TrainConfig(dp=True))


def test_bounds_name_the_argument_the_bound_and_why():
    from engine.validation import at_least, at_most

    assert at_most("x", 3, 4) == 3 and at_least("x", 1.0, 1.0) == 1.0
    with pytest.raises(ValueError, match=r"^x must be at most 4,294,967,295 \(why\), got "
                                         "1099511627776$"):
        at_most("x", 2**40, 2**32 - 1, " (why)")
    with pytest.raises(ValueError, match=r"^x must be at most 86,400 seconds, got 1e\+20$"):
        at_most("x", 1e20, 86_400.0, " seconds")
    with pytest.raises(ValueError, match=r"^x must be at least 0.5, got 0.1$"):
        at_least("x", 0.1, 0.5)
