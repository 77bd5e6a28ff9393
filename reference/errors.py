"""Error types. Each names what is wrong; the command line turns them into
one line and an exit status (2 for bad input or a refusal, 3 for a run
stopped by non-finite values)."""


class CoppeliusError(Exception):
    """An expected error: shown to a user as one line, exit status 2."""

    exit_status = 2


class ConfigError(CoppeliusError, ValueError):
    """A configuration or hyperparameter field is invalid (names the field)."""


class StreamError(CoppeliusError):
    """A token stream file is malformed (names the file and the offset)."""


class CheckpointError(CoppeliusError):
    """A checkpoint file is malformed or cannot be published (names the file)."""


class IdentityMismatch(CheckpointError):
    """A checkpoint's identity differs from the run's (names the key, both values)."""


class ResultFileError(CoppeliusError):
    """A result file is malformed or would be overwritten (names the file)."""


class RunError(CoppeliusError):
    """A run cannot start as asked (too few contexts, bad options, ...)."""


class NonFiniteError(CoppeliusError):
    """A row loss or parameter became non-finite: the run stops, exit status 3."""

    exit_status = 3


class OutputError(CoppeliusError):
    """An output path cannot be written as asked: it names a FIFO, a device or
    a directory, a file that is not this command's to replace, or a name the
    file system cannot hold (names the path)."""


class InUseError(CoppeliusError):
    """Another process holds the lock on a file this command would write
    (names the file and, where known, the holder's pid)."""


class NotRegularFile(OSError):
    """A path that is read or published names a FIFO, a device, a socket or a
    directory. An OSError, so that every reader and writer reports it in its
    own words (`checkpoint X: cannot read: is a FIFO ...`), as it reports any
    other file-system failure."""
