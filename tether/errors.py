"""Errors a user can fix: printed as one line by the CLI, never as a traceback."""


class UserError(ValueError):
    """Bad input (data row, model path, config combination). The message is one line that names
    the file, row and field (or the key) and says what is wrong."""


class NonFiniteLossError(RuntimeError):
    """A loss or gradient went NaN/inf; the step was skipped and no weights were changed."""


class TrainingDiverged(UserError):
    """A run stopped because its updates kept being refused (non-finite loss, gradients or weights)
    or its weights went non-finite: one line, and no checkpoint of non-finite weights is written."""
