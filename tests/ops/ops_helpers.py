"""Shared by the ops tests."""

import pytest


def argument_error_test(bad_calls):
    """A test over every (words, call) that `bad_calls()` lists: the call raises ValueError matching words.
    `bad_calls` is a function so that each case builds fresh tensors."""

    @pytest.mark.parametrize("index", range(len(bad_calls())))
    def test_argument_errors(index):
        words, call = bad_calls()[index]
        with pytest.raises(ValueError, match=words):
            call()

    return test_argument_errors
