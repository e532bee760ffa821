"""Errors a user can fix: printed as one line by the CLI, never as a traceback."""


class UserError(ValueError):
    """Bad input (data row, model path, config combination). The message is one line that names
    the file, row and field (or the key) and says what is wrong."""


class NonFiniteLossError(RuntimeError):
    """A loss or gradient went NaN/inf; the step was skipped and no weights were changed."""


class TrainingDiverged(UserError):
    """A run stopped because its updates kept being refused (non-finite loss, gradients or weights)
    or its weights went non-finite: one line, and no checkpoint of non-finite weights is written."""


class DiskFullError(UserError):
    """The disk, a quota or a file-size limit filled while a run wrote its directory, and the run
    stopped: one line naming the run, the file, the cause and the last complete checkpoint, which
    is intact and resumable (a checkpoint is renamed into place only once whole)."""
