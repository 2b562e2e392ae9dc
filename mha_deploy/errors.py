"""Error types users can catch.

Every error mha-deploy raises on bad input derives from ``MHADeployError`` and
carries a message that says what was wrong and, where possible, what to do.
"""


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


def first_line(error: BaseException | str) -> str:
    """The first line of an error, for one-line messages; a long one (ORT names the failing node first and the
    reason last, a C++ signature between) as its start and its end."""
    text = str(error).strip()
    if not text:
        return type(error).__name__ if isinstance(error, BaseException) else ""
    line = text.splitlines()[0]
    return line if len(line) <= 320 else f"{line[:170]} ... {line[-140:]}"
