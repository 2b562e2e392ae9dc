"""Error types users can catch.

Every error mha-deploy raises on bad input derives from ``MHADeployError`` and
carries a message that says what was wrong and, where possible, what to do.
"""

import functools


class MHADeployError(Exception):
    """Base class of every error mha-deploy raises on purpose."""


class CheckpointError(MHADeployError, ValueError):
    """A checkpoint could not be read or does not describe a reference MHA."""


class ExportError(MHADeployError):
    """The requested export is invalid or torch.onnx.export failed."""


class SignatureError(MHADeployError, ValueError):
    """A model's inputs and outputs were declared in a way no model can have (a mask marking no sequence)."""


class ParityError(ExportError):
    """ONNX Runtime and the torch reference disagree beyond the tolerance."""


class ModelFileError(MHADeployError):
    """An ONNX file is missing, corrupt, or not an mha-deploy model."""


class InputError(MHADeployError, ValueError):
    """Inputs given to a session or runner do not match the model."""


class ProviderUnavailableError(MHADeployError):
    """The requested execution provider cannot run on this machine."""


class ModelConfigError(MHADeployError, ValueError):
    """A reference model was asked for with sizes it cannot have (e.g. heads not dividing d_model)."""


class BatchingConfigError(MHADeployError, ValueError):
    """Micro-batching options are out of range."""


class BatcherStoppedError(MHADeployError, RuntimeError):
    """The micro-batcher's collecting loop has died, so no request can run; restart the server."""


class OptionError(MHADeployError, ValueError):
    """An option was given a value it does not take (e.g. an unknown optimization level)."""


class OutputError(MHADeployError):
    """A job's output cannot be written, or holds something the job will not overwrite."""


class OutputInUseError(OutputError):
    """Another process holds the output's lock: it is writing that output now."""


# What the export functions raise for the problems other layers find (a Signature no model can have, a
# checkpoint that does not fit, the written model refused on load, a file that cannot be written): an
# ExportError, as they document, and still the original type, so that either except clause catches it.
class SignatureExportError(ExportError, SignatureError):
    """An export whose declared inputs and outputs make a Signature no model can have."""


class CheckpointExportError(ExportError, CheckpointError):
    """An export whose checkpoint cannot be read or does not fit the module."""


class ModelFileExportError(ExportError, ModelFileError):
    """An export whose model the runtime's load checks refuse."""


class OutputExportError(ExportError, OutputError):
    """An export whose model file cannot be written."""


_EXPORT_KINDS = (
    (SignatureError, SignatureExportError),
    (CheckpointError, CheckpointExportError),
    (ModelFileError, ModelFileExportError),
    (OutputError, OutputExportError),
)


def as_export_error(error: MHADeployError) -> MHADeployError:
    """``error`` as an ``ExportError`` that is still of its own kind (same message); other errors as they are."""
    if isinstance(error, ExportError):
        return error
    kind = next((export_kind for own, export_kind in _EXPORT_KINDS if isinstance(error, own)), None)
    return error if kind is None else kind(*error.args)


def raises_export_errors(function):
    """``function`` raising every error of another layer through ``as_export_error``: what it documents."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except MHADeployError as error:
            converted = as_export_error(error)
            if converted is error:
                raise
            raise converted from error

    return wrapper


def first_line(error: BaseException | str) -> str:
    """The first line of an error, for one-line messages; a long one (ORT names the failing node first and the
    reason last, a C++ signature between) as its start and its end."""
    text = str(error).strip()
    if not text:
        return type(error).__name__ if isinstance(error, BaseException) else ""
    line = text.splitlines()[0]
    return line if len(line) <= 320 else f"{line[:170]} ... {line[-140:]}"
