"""Ember's exceptions: one class per absl/gRPC status code, all EmberError."""


class EmberError(Exception):
    """An Ember call failed. `code` is the absl/gRPC status code (int), `name`
    its name; the message is the server's."""

    name = "UNKNOWN"

    def __init__(self, code, message):
        super().__init__(f"{self.name}: {message}")
        self.code = code
        self.message = message


class Cancelled(EmberError):
    name = "CANCELLED"


class Unknown(EmberError):
    name = "UNKNOWN"


class InvalidArgument(EmberError):
    name = "INVALID_ARGUMENT"


class DeadlineExceeded(EmberError):
    name = "DEADLINE_EXCEEDED"


class NotFound(EmberError):
    name = "NOT_FOUND"


class AlreadyExists(EmberError):
    name = "ALREADY_EXISTS"


class PermissionDenied(EmberError):
    name = "PERMISSION_DENIED"


class ResourceExhausted(EmberError):
    name = "RESOURCE_EXHAUSTED"


class FailedPrecondition(EmberError):
    name = "FAILED_PRECONDITION"


class Aborted(EmberError):
    name = "ABORTED"


class OutOfRange(EmberError):
    name = "OUT_OF_RANGE"


class Unimplemented(EmberError):
    name = "UNIMPLEMENTED"


class Internal(EmberError):
    name = "INTERNAL"


class Unavailable(EmberError):
    name = "UNAVAILABLE"


class DataLoss(EmberError):
    name = "DATA_LOSS"


class Unauthenticated(EmberError):
    name = "UNAUTHENTICATED"


_BY_CODE = {
    1: Cancelled, 2: Unknown, 3: InvalidArgument, 4: DeadlineExceeded, 5: NotFound,
    6: AlreadyExists, 7: PermissionDenied, 8: ResourceExhausted, 9: FailedPrecondition,
    10: Aborted, 11: OutOfRange, 12: Unimplemented, 13: Internal, 14: Unavailable,
    15: DataLoss, 16: Unauthenticated,
}


def error_class(code):
    """The exception class for a status code (EmberError for unknown codes)."""
    return _BY_CODE.get(code, EmberError)
