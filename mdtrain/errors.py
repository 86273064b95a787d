"""User-facing errors: printed as one line by the CLI, without a traceback unless --debug."""


class MDTrainError(Exception):
    """A problem with the user's input, data, files or environment.

    The message must name what is wrong and where (file, JSON path, system, frame or
    checkpoint), so that a single line is enough to fix it.
    """
