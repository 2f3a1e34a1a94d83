"""Status codes coming back from a task map onto the one error hierarchy, recoverable where waiting helps."""

import grpc

from tensorfleet.errors import InvalidArgumentError, NotInitializedError, UnavailableError
from tensorfleet.wire.rpc import _error_for


def test_calls_cancelled_by_a_server_going_away_are_recoverable():
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED):
        error = _error_for(code, "gone", "/job:ps/task:1")
        assert isinstance(error, UnavailableError) and error.recoverable
    assert isinstance(_error_for(grpc.StatusCode.INVALID_ARGUMENT, "bad", "t"), InvalidArgumentError)


def test_not_initialized_is_recoverable_and_named():
    error = _error_for(grpc.StatusCode.FAILED_PRECONDITION, "waiting for the chief", "/job:ps/task:0")
    assert isinstance(error, NotInitializedError) and error.recoverable and "/job:ps/task:0" in str(error)
