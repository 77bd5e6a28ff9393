"""Files: atomic, durable publication (SPEC section 10), the checks every
command applies to the paths it reads and writes, and the lock of a file in
use.

Publication. The body is written to a temporary in the destination's
directory, flushed and fsynced, renamed over the destination, and the
directory is fsynced, so the path holds either the old complete file or the
new complete file, whatever instant the process dies at. A failure (ENOSPC,
say) removes the temporary and leaves the old file as it was.

What is never touched. Only a regular file is ever replaced: a path naming a
FIFO, a device, a socket or a directory is refused (renaming over
`/dev/null` would replace the device node itself). A symbolic link is
published through: the file it points to is replaced and the link stays.
Only a regular file is ever opened for reading: opening a FIFO blocks until a
writer appears, reading a device may never end.

Temporaries. A temporary is named `.<name>.<random>.coppelius.tmp` beside
its destination (the name shortened so that the temporary fits the file
system's limit however long the destination's name is) and is locked
(flock) by its writer while it lives. A process killed outright leaves it
behind unlocked; `remove_stale` removes those before the next publication,
and never one a live writer holds.

Signals. Making a temporary, renaming it and removing it are short steps
that a signal's exception (Ctrl-C, or SIGTERM turned into one) must not cut
in two, or the temporary would be left with nobody to remove it:
`signals_deferred()` holds SIGINT, SIGTERM and SIGHUP over them and lets
them in once the step is done. Writing a body is not held: a long write
stays interruptible, and its temporary is removed.

Locks. `Lock(path)` is an exclusive flock on `.<name>.lock` beside the file,
held for as long as a command uses the file and released by the kernel when
the process ends however it ends, so a crash leaves no stale lock. The lock
file holds the holder's pid, for the message that refuses a second process.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import signal
import stat
import tempfile
import threading

from .errors import InUseError, NotRegularFile, OutputError

# Test seam: called with a phase name ("written", "synced", "renamed") so the
# crash tests can kill the process between the steps of publication.
_hook = None

TEMP_SUFFIX = ".coppelius.tmp"
# what earlier versions named their temporaries: still recognised as stale
_LEGACY_SUFFIXES = (".tmp", ".staged")
_RANDOM = "[a-z0-9_]{8}"  # tempfile.mkstemp's random part
DEFAULT_NAME_MAX = 255  # bytes of one name: Linux, macOS, the common file systems


def _phase(name: str) -> None:
    if _hook is not None:
        _hook(name)


# ------------------------------------------------------------------ signals

DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGINT, SIGTERM and SIGHUP for the block and deliver them, in
    the order they came, once it is over: a handler that raises (Ctrl-C's
    KeyboardInterrupt) then raises after the block, never inside it. Python
    runs handlers on the main thread only, so elsewhere there is nothing to
    hold and the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received, old = [], {}
    try:
        for sig in DEFERRED_SIGNALS:
            if signal.getsignal(sig) is not None:  # None: a handler not Python's, left alone
                old[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for signum in received:
            _deliver(signum, old[signum])


def _deliver(signum: int, handler) -> None:
    """What the signal `signum` would have done under `handler`."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:  # the default action (SIGTERM's: the process ends)
        signal.raise_signal(signum)


# ------------------------------------------------------------------ file kinds

def kind(mode: int) -> str:
    """What a non-regular st_mode is, in words."""
    for test, words in ((stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket"),
                        (stat.S_ISDIR, "a directory"),
                        (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return words
    return "not a regular file"


def _not_regular(path, mode: int) -> OSError:
    """The OSError a reader or writer raises for a path that is not a
    regular file (IsADirectoryError for a directory, as open() would)."""
    if stat.S_ISDIR(mode):
        return IsADirectoryError(errno.EISDIR, "is a directory, not a regular file", path)
    return NotRegularFile(errno.EINVAL, f"is {kind(mode)}, not a regular file", path)


def regular_or_absent(path):
    """os.stat of `path` (symlinks followed), or None when nothing is there;
    NotRegularFile (an OSError) when it is a FIFO, a device, a socket or a
    directory. Other OSErrors (permissions, a loop) propagate."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(os.fspath(path), st.st_mode)
    return st


def _open_nonblocking_regular(path: str) -> int:
    """A descriptor of the regular file `path`, opened without blocking:
    checked before the open (a FIFO or a device is never opened) and again
    on the open file (one swapped in between is closed, refused)."""
    if regular_or_absent(path) is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path):
    """`path` open for reading (binary), refused with an OSError
    (NotRegularFile, IsADirectoryError) unless it is a regular file.

    Checked before opening, so that a FIFO is never opened (that blocks
    until a writer appears) and a device is never opened (that may have
    effects of its own); opened without blocking and checked again on the
    open file, so that a FIFO swapped in between cannot block either."""
    path = os.fspath(path)
    fd = _open_nonblocking_regular(path)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path, limit: int) -> bytes:
    """At most `limit` + 1 bytes of the regular file `path` (a caller that
    gets more than `limit` knows the file is too large without reading it
    all). Read without blocking: a "regular" file that waits for data that
    may never come (/proc/kmsg) is an OSError (EAGAIN), not a hang. The
    errors are open_regular's."""
    path = os.fspath(path)
    fd = _open_nonblocking_regular(path)
    try:
        pieces, got = [], 0
        while got <= limit:
            try:
                piece = os.read(fd, min(limit + 1 - got, 1 << 20))
            except BlockingIOError:
                raise BlockingIOError(errno.EAGAIN, "it would wait for data that may never "
                                                    "come; not an ordinary file", path) from None
            if not piece:
                break
            pieces.append(piece)
            got += len(piece)
        return b"".join(pieces)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ small documents

class DocumentError(ValueError):
    """A small JSON document this project reads is not one it accepts (the
    message says why; the caller names the file)."""


def json_depth(text: str) -> int:
    """How deeply the arrays and objects of the JSON `text` nest (its strings
    left out), counted without parsing: a parser recurses once per level."""
    brackets = re.sub(r"[^][{}]", "", re.sub(r'"(?:[^"\\]|\\.)*"', "", text))
    depth = deepest = 0
    for c in brackets:
        depth += 1 if c in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def parse_json(raw: bytes, max_depth: int, max_digits: int = 40):
    """The JSON document `raw` (UTF-8), refused (DocumentError) when it nests
    deeper than `max_depth`, repeats a key of an object, holds NaN or an
    infinity, or a number of more than `max_digits` characters."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DocumentError(f"not UTF-8 (byte offset {e.start})") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise DocumentError(f"nested {depth} levels deep; at most {max_depth} are read")

    def number(kind):
        def parse(token):
            if len(token) > max_digits:
                raise DocumentError(f"a number of {len(token)} characters; at most "
                                    f"{max_digits} are read")
            return kind(token)
        return parse

    def constant(name):
        raise DocumentError(f"{name} is not a JSON number")

    def unique(pairs):
        out = {}
        for key, value in pairs:
            if key in out:
                raise DocumentError(f"key {key!r} appears twice")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=unique, parse_int=number(int),
                          parse_float=number(float), parse_constant=constant)
    except DocumentError:
        raise
    except (ValueError, RecursionError) as e:
        raise DocumentError(f"not JSON ({e})") from None


def path_argument(text: str) -> str:
    """The argparse type of a path option: an empty path is refused rather
    than read as "not given" (which would fall back to a default)."""
    if not text:
        raise argparse.ArgumentTypeError("empty path")
    return text


# ------------------------------------------------------------------ names

def name_max(directory) -> int:
    """The longest name (bytes) the file system of `directory` (or of its
    nearest existing ancestor) allows."""
    directory = os.path.abspath(os.fspath(directory))
    while True:
        try:
            return os.pathconf(directory, "PC_NAME_MAX")
        except (OSError, ValueError):
            parent = os.path.dirname(directory)
            if parent == directory:
                return DEFAULT_NAME_MAX
            directory = parent


def _shortened(name: str, room: int) -> str:
    """`name` cut to at most `room` bytes of its file-system encoding."""
    raw = os.fsencode(name)
    return name if len(raw) <= room else os.fsdecode(raw[:room])


def _temp_prefix(target: str) -> str:
    directory, name = os.path.split(target)
    room = name_max(directory) - len(f"..{'x' * 8}{TEMP_SUFFIX}")
    return "." + _shortened(name, room) + "."


def _temp_pattern(target: str):
    prefix = _temp_prefix(target)
    name = os.path.basename(target)
    legacy = "|".join(re.escape(f".{name}.") + _RANDOM + re.escape(s) for s in _LEGACY_SUFFIXES)
    return re.compile(re.escape(prefix) + _RANDOM + re.escape(TEMP_SUFFIX) + "|" + legacy)


def lock_path(path) -> str:
    """The lock file of `path`: `.<name>.lock` beside the file it names (a
    symlink's target, so that every name of one file takes one lock), the
    name shortened and made unique by a digest where it would not fit."""
    target = os.path.realpath(os.fspath(path))
    directory, name = os.path.split(target)
    lock = f".{name}.lock"
    if len(os.fsencode(lock)) > name_max(directory):
        digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
        lock = "." + _shortened(name, name_max(directory) - 24) + f"-{digest}.lock"
    return os.path.join(directory, lock)


# ------------------------------------------------------------------ outputs

def _target(path) -> str:
    """The file a publication to `path` replaces: a symlink's target. An
    OSError when it exists and is not a regular file, or its name is longer
    than the file system allows."""
    target = os.path.realpath(os.fspath(path))
    regular_or_absent(target)
    directory, name = os.path.split(target)
    if len(os.fsencode(name)) > name_max(directory):
        raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), os.fspath(path))
    return target


def _check_replaceable_here(target: str, what: str, shown: str) -> None:
    """A publication replaces `target` by a rename, which a folder with the
    sticky bit (/tmp, shared folders) allows only to the file's owner, the
    folder's owner and root: another user's file there is refused now,
    not at the first publication after the work is done (EPERM)."""
    try:
        st = os.stat(target)
        folder = os.stat(os.path.dirname(target) or ".")
    except FileNotFoundError:
        return
    me = os.geteuid()
    if folder.st_mode & stat.S_ISVTX and me not in (0, st.st_uid, folder.st_uid):
        raise OutputError(f"{what} {shown}: belongs to user {st.st_uid} in a folder with the "
                          f"sticky bit, which lets no other user replace it; write elsewhere")


def output_target(path, what: str) -> str:
    """Check an output path before any work is done, and return the file a
    publication to it replaces (a symlink's target). Refused with an
    OutputError naming `what` and the path: an empty path, a FIFO, a device,
    a socket or a directory, a name longer than the file system allows. A
    missing directory is not refused here: creating it says why it fails."""
    shown = os.fspath(path)
    if not shown:
        raise OutputError(f"{what}: empty path")
    try:
        target = _target(path)
        _check_replaceable_here(target, what, shown)
        return target
    except (FileNotFoundError, NotADirectoryError):
        return os.path.realpath(shown)  # a parent is missing or a file: found when it is made
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            name = os.path.basename(os.path.realpath(shown))
            raise OutputError(f"{what} {shown}: the name is {len(os.fsencode(name))} bytes, longer "
                              f"than the file system allows") from None
        if isinstance(e, (NotRegularFile, IsADirectoryError)):
            raise OutputError(f"{what} {shown}: {e.strerror}; refusing to replace it") from None
        raise OutputError(f"{what} {shown}: {e.strerror or e}") from None


def same_file(a, b) -> bool:
    """Whether two paths name one existing file (through links)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(os.fspath(a)) == os.path.realpath(os.fspath(b))


# ------------------------------------------------------------------ temporaries

def _temporary(target: str) -> tuple:
    """(fd, path) of a new temporary beside `target`, locked by this process."""
    directory = os.path.dirname(target)
    prefix = _temp_prefix(target)
    while True:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=TEMP_SUFFIX, dir=directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return fd, tmp  # no locks on this file system: remove_stale cannot tell, leaves it
        # remove_stale may have taken the unlocked new file for a leftover
        try:
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return fd, tmp
        except FileNotFoundError:
            pass
        os.close(fd)


def remove_stale(path) -> int:
    """Remove the temporaries of publications to `path` that no live process
    holds (left by a process killed outright); returns how many."""
    try:
        target = os.path.realpath(os.fspath(path))
        directory = os.path.dirname(target)
        pattern = _temp_pattern(target)
        names = os.listdir(directory)
    except OSError:
        return 0
    removed = 0
    for name in names:
        if not pattern.fullmatch(name):
            continue
        candidate = os.path.join(directory, name)
        try:
            fd = os.open(candidate, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: a live writer's
            if os.stat(candidate).st_ino == st.st_ino:
                os.unlink(candidate)
                removed += 1
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


class Staged:
    """A complete, synced temporary waiting to be renamed over its
    destination: `commit()` publishes it, `discard()` removes it."""

    def __init__(self, target: str, tmp: str, f):
        self.target, self.tmp, self._f = target, tmp, f

    def commit(self, replace: bool = True) -> None:
        """Rename the temporary over the destination (replace=True), or link
        it there only if nothing is there yet (replace=False: FileExistsError
        otherwise, and nothing changes)."""
        try:
            with signals_deferred():  # renamed and forgotten as one step
                if replace:
                    _target(self.target)  # still absent or a regular file
                    os.replace(self.tmp, self.target)
                else:
                    _link_new(self.tmp, self.target)
                self.tmp = None
            _phase("renamed")
        finally:
            self.discard()
        fsync_directory(os.path.dirname(self.target))

    def discard(self) -> None:
        with signals_deferred():  # removed whole: a signal waits until it is gone
            if self.tmp is not None:
                try:
                    os.unlink(self.tmp)
                except FileNotFoundError:
                    pass
                self.tmp = None
            if self._f is not None:
                f, self._f = self._f, None
                f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.discard()


def _link_new(tmp: str, target: str) -> None:
    """Publish `tmp` at `target` only if `target` does not exist: a hard
    link fails rather than replace (rename would replace)."""
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EXDEV):
            raise
        # no hard links here: claim the name first, then rename over the claim
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        os.replace(tmp, target)
        return
    os.unlink(tmp)


def stage(path, write_body) -> Staged:
    """Write a whole file for `path` to a temporary beside it and sync it;
    `write_body(f)` writes the file to `f`. Raises OSError on failure, with
    nothing left behind and `path` untouched."""
    target = _target(path)
    remove_stale(target)
    fd = tmp = f = None
    try:
        with signals_deferred():  # made and known to this block as one step
            fd, tmp = _temporary(target)
        # mkstemp creates 0600; a published file gets the ordinary 0666 & ~umask
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        f = os.fdopen(fd, "wb")
        write_body(f)
        f.flush()
        _phase("written")
        os.fsync(f.fileno())
        _phase("synced")
    except BaseException:
        with signals_deferred():  # removed whole: a second signal waits until it is gone
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
            if f is not None:
                f.close()
            elif fd is not None:
                os.close(fd)
        raise
    # The file stays open (and locked) until it is renamed: remove_stale
    # must not take it for a leftover meanwhile.
    return Staged(target, tmp, f)


def publish(path, write_body, replace: bool = True) -> None:
    """Publish `path` atomically; `write_body(f)` writes the whole file to
    `f`. Raises OSError on failure, leaving `path` untouched. With
    replace=False an existing file is never replaced (FileExistsError)."""
    stage(path, write_body).commit(replace)


def fsync_directory(directory: str) -> None:
    """Make a rename durable: fsync the directory that holds the entry."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ locks

class Lock:
    """An exclusive lock on the file `path` names, held by this process (see
    the module docstring). `what` names the file in a refusal."""

    def __init__(self, path, what: str):
        self.file = os.fspath(path)
        self.what = what
        self.path = lock_path(path)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, wait: bool = False) -> "Lock":
        """Take the lock, or raise InUseError naming the file and the holder's
        pid; with `wait`, wait for the holder to let it go instead. The lock
        file's directory must exist."""
        if self._fd is not None:
            return self
        while True:
            try:
                regular_or_absent(self.path)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                             | os.O_CLOEXEC, 0o666)
            except OSError as e:
                raise OutputError(f"{self.what} {self.file}: cannot lock it with {self.path} "
                                  f"({e.strerror or e})") from None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise OutputError(f"{self.what} {self.file}: its lock {self.path} is "
                                      f"{kind(st.st_mode)}, not a regular file")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
                except BlockingIOError:
                    holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                    by = f"process {holder}" if holder.isdigit() else "another process"
                    raise InUseError(f"{self.what} {self.file}: in use by {by} (lock "
                                     f"{self.path}); wait for it to finish or stop it") from None
                except OSError as e:
                    raise OutputError(f"{self.what} {self.file}: cannot lock it with {self.path} "
                                      f"({e.strerror or e})") from None
                # The holder before us removes the file as it releases: the
                # file we locked must still be the one at the path.
                try:
                    current = os.stat(self.path, follow_symlinks=False)
                    same = (current.st_dev, current.st_ino) == (st.st_dev, st.st_ino)
                except FileNotFoundError:
                    same = False
                if same:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
                    self._fd, fd = fd, None
                    return self
            finally:
                if fd is not None:
                    os.close(fd)

    def release(self) -> None:
        """Remove the lock file and let the lock go (removed while still
        held, so no process can lock a file that is about to disappear)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
