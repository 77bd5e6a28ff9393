"""Atomic, durable publication of a file (SPEC section 10).

The body is written to a temporary in the destination's directory, flushed
and fsynced, renamed over the destination, and the directory is fsynced, so
the path holds either the old complete file or the new complete file,
whatever instant the process dies at. A failure (ENOSPC, say) removes the
temporary and leaves the old file as it was.
"""

from __future__ import annotations

import os
import tempfile

# Test seam: called with a phase name ("written", "synced", "renamed") so the
# crash tests can kill the process between the steps of publication.
_hook = None


def _phase(name: str) -> None:
    if _hook is not None:
        _hook(name)


def publish(path, write_body) -> None:
    """Publish `path` atomically; `write_body(f)` writes the whole file to `f`.
    Raises OSError on failure, leaving `path` untouched."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                               dir=directory)
    try:
        # mkstemp creates 0600; a published file gets the ordinary 0666 & ~umask
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            write_body(f)
            f.flush()
            _phase("written")
            os.fsync(f.fileno())
        _phase("synced")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _phase("renamed")
    fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """Make a rename durable: fsync the directory that holds the entry."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
