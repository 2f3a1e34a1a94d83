"""Remote functions travel by name: two of one name are told apart, not confused."""

from __future__ import annotations

import types, pytest
import tensorfleet as tfl
from tensorfleet.coordinator.remote import name_of
from tensorfleet.errors import InvalidArgumentError

def test_two_remote_functions_of_one_name_are_told_apart():
    first = types.FunctionType((lambda: 1).__code__, {}, "twin"); first.__qualname__ = "twin"; first.__module__ = "a"
    second = types.FunctionType((lambda: 2).__code__, {}, "twin"); second.__qualname__ = "twin"; second.__module__ = "b"
    tfl.remote(first); tfl.remote(second)
    assert name_of(second) == "twin"
    with pytest.raises(InvalidArgumentError, match=r"'twin' names another remote function \(of b, marked after this one of a\)"):
        name_of(first)
