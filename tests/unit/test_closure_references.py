"""A malformed ``$tensor`` / ``$per_worker`` reference in a Run is the caller's error (INVALID_ARGUMENT, one line),
never an error inside the worker (issue 41: a list as the name raised TypeError, answered INTERNAL with a trace)."""

from __future__ import annotations

import pytest
import torch

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.closures import unpack


@pytest.mark.parametrize("reference", [{"$tensor": [1]}, {"$tensor": {"a": 1}}, {"$tensor": None}, {"$tensor": 3},
                                       {"$per_worker": []}, {"$per_worker": {"x": 1}}, {"$per_worker": 2.5}])
def test_a_reference_that_names_nothing_by_a_string_is_refused_in_one_line(reference):
    with pytest.raises(InvalidArgumentError, match="reference must name it with a string") as raised:
        unpack([reference], {"arg/0": torch.ones(1)}, {"kept": 1})
    assert "\n" not in raised.value.message


def test_well_formed_references_still_resolve():
    tensor = torch.ones(2)
    assert unpack([{"$tensor": "arg/0"}, {"$per_worker": "kept"}], {"arg/0": tensor}, {"kept": 7}) == [tensor, 7]
