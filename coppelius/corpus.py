"""Sources as lists of documents, concatenated in the keyed order (SPEC section 8).

A source is one of:

- the embedded corpus (no source named): every `.py` file under the running
  Python's `sysconfig` stdlib path except those under `site-packages`;
- a folder: every text file under it;
- a file: that one file.

Documents are numbered 0, 1, ... in sorted relative-path order (POSIX
separators, plain string order) and concatenated by increasing key
`mix(20260925 + (i + 1) * GAMMA)` (SPEC 2's splitmix64, shared with the
initialization through coppelius.reference.params.mix_keys). Each document of
the embedded corpus or of a folder is preceded by a line `# file: <relative
path>` and ends with a newline (one is added where it lacks one), so every
marker is a line of its own; a single file's text is used as it is.

Which entries of a folder are documents (SPEC 8, Reading):

- hidden entries (a name starting with "."), files and folders alike, are
  left out unread and uncounted: .git, .venv, editor swap files;
- symbolic links are not followed, neither to files nor to folders, so a
  source never reads outside its tree (or the same file twice); they are
  counted as skipped, as are sockets, FIFOs and devices, which are never
  opened, files that cannot be read, and names that are not UTF-8 (the
  marker line could not hold them);
- a regular file is binary, skipped and counted, when it holds a NUL byte
  or its bytes are not UTF-8. Every document is read whole anyway, so the
  rule is exact rather than a guess from a prefix; the first 8 KiB are
  looked at first, so most binary files are turned down without reading
  the rest of them.

The embedded corpus keeps its version-1 reading: every `.py` file is a
document, invalid UTF-8 replaced by U+FFFD, so the list is the same on every
machine with the same Python; a file the process may not read is left out.

A listing's stamp is the newest document's modification time (ns) and the
documents' total size in bytes: the stream header's two fields.
"""

from __future__ import annotations

import os
import platform
import stat
import sysconfig
from dataclasses import dataclass, field

import numpy as np

from coppelius.reference.errors import StreamError
from coppelius.reference.params import mix_keys

# SPEC 8's literal. It is the initialization's default seed too, but never
# --seed: the stream (and with it the data identity) must not depend on how
# a run initializes its parameters.
DOCUMENT_SEED = 20260925
SNIFF_BYTES = 8192  # the prefix looked at for a NUL before reading a file whole
MARKER = "# file: {}\n"

EMBEDDED, FOLDER, FILE = "embedded", "folder", "file"


@dataclass
class Listing:
    """A source's documents, read and ordered.

    documents: relative paths in the keyed order (the order of the text);
    texts: each document's text, in the same order;
    binary, skipped: relative paths left out (see the module docstring), sorted."""

    kind: str  # EMBEDDED, FOLDER or FILE
    root: str  # the stdlib folder, the folder or the file
    name: str  # the stem the stream cache names its folder after
    documents: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    binary: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    mtime_ns: int = 0  # the newest document's modification time
    size: int = 0  # the documents' total size in bytes

    @property
    def stamp(self) -> tuple:
        """(mtime_ns, size): what the stream header records."""
        return self.mtime_ns, self.size

    def text(self) -> str:
        """The source text: the documents in the keyed order, each behind its
        marker line (a single file: its text as it is)."""
        if self.kind == FILE:
            return self.texts[0]
        return "".join(MARKER.format(rel) + text for rel, text in zip(self.documents, self.texts))

    def summary(self) -> str:
        """'1,234 documents, 2 binary files skipped' for the command line."""
        return summary(len(self.documents), len(self.binary), len(self.skipped))


def summary(documents: int, binary: int, skipped: int) -> str:
    text = f"{documents:,} document{'s' if documents != 1 else ''}"
    if binary:
        text += f", {binary:,} binary file{'s' if binary != 1 else ''} skipped"
    if skipped:
        text += f", {skipped:,} other entr{'ies' if skipped != 1 else 'y'} skipped"
    return text


def keyed_order(n: int) -> list:
    """The document numbers 0..n-1 (sorted relative-path order) in the order
    of the text: by increasing key mix(20260925 + (i + 1) * GAMMA). The keys
    are distinct (mix is a bijection, GAMMA odd), so no tie needs breaking."""
    keys = mix_keys(DOCUMENT_SEED, n)  # (n,) uint64
    return [int(i) for i in np.argsort(keys, kind="stable")]


# ---------------------------------------------------------------------------
# Reading one file without ever blocking on it

def read_regular(path, follow: bool = False, sniff: bool = False):
    """(bytes, mtime_ns) of a regular file, or None when `path` is anything
    else: a FIFO, a device, a socket, or (unless `follow`) a symbolic link.
    The file is opened non-blocking and what was opened is checked, so a FIFO
    swapped in after a listing cannot hang the read. With `sniff`, a file
    whose first SNIFF_BYTES hold a NUL gives (None, mtime_ns): binary, the
    rest is not read. Raises OSError when the file cannot be read."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if not follow and os.path.islink(path):  # O_NOFOLLOW's ELOOP: a link, not a file
            return None
        raise
    with open(fd, "rb") as f:  # owns fd from here
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        body = f.read(SNIFF_BYTES) if sniff else b""
        if b"\0" in body:
            return None, st.st_mtime_ns
        return body + f.read(), st.st_mtime_ns


def _fs_error(what: str, e: OSError) -> StreamError:
    return StreamError(f"{what} ({e.strerror or e})")


# ---------------------------------------------------------------------------
# The three kinds of source

def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def default_source_name() -> str:
    return f"stdlib-{platform.python_version()}"


def stdlib_files(root: str) -> list:
    """Relative POSIX paths of every .py file under `root`, none under a
    site-packages directory, sorted."""
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d != "site-packages"]
        rel_dir = os.path.relpath(directory, root)
        for name in files:
            if name.endswith(".py"):
                rel = os.path.normpath(os.path.join(rel_dir, name))
                found.append(rel.replace(os.sep, "/"))
    return sorted(found)


def _ordered(listing: Listing, found: list) -> Listing:
    """Fill `listing` from `found` [(rel, text, mtime_ns, size)] sorted by rel."""
    for i in keyed_order(len(found)):
        rel, text, _, _ = found[i]
        listing.documents.append(rel)
        listing.texts.append(text)
    listing.mtime_ns = max((m for _, _, m, _ in found), default=0)
    listing.size = sum(n for _, _, _, n in found)
    return listing


def _with_newline(text: str) -> str:
    """A document's text ending with a newline, so the next marker is a line
    of its own (an empty document stays empty: its marker line is all of it)."""
    return text if not text or text.endswith("\n") else text + "\n"


def embedded_listing(root: str | None = None) -> Listing:
    """The embedded default source (see the module docstring)."""
    root = root or stdlib_root()
    found = []
    for rel in stdlib_files(root):
        try:
            # links followed, as version 1 read the stdlib (a distribution may
            # link a module to a file elsewhere)
            got = read_regular(os.path.join(root, *rel.split("/")), follow=True)
        except OSError:
            continue  # unreadable on this machine (permissions): not part of the corpus
        if got is None:
            continue
        body, mtime_ns = got
        found.append((rel, _with_newline(body.decode("utf-8", errors="replace")), mtime_ns,
                      len(body)))
    return _ordered(Listing(EMBEDDED, root, default_source_name()), found)


def folder_entries(root: str) -> tuple:
    """(files, skipped) under `root`: relative POSIX paths of the regular
    files that are candidates for documents, and of the entries skipped
    unread (links, special files, folders that cannot be listed, names that
    are not UTF-8); hidden entries are in neither. Both sorted."""
    files, skipped = [], []
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        try:
            with os.scandir(os.path.join(root, *rel_dir.split("/")) if rel_dir else root) as it:
                entries = list(it)
        except OSError as e:
            if not rel_dir:
                raise _fs_error(f"source {root}: cannot list the folder", e) from None
            skipped.append(rel_dir)
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:  # undecodable bytes in the name (surrogate escapes)
                skipped.append(rel)
                continue
            try:
                if entry.is_symlink():
                    skipped.append(rel)
                elif entry.is_dir(follow_symlinks=False):
                    pending.append(rel)
                elif entry.is_file(follow_symlinks=False):
                    files.append(rel)
                else:  # FIFO, socket, device: never opened
                    skipped.append(rel)
            except OSError:
                skipped.append(rel)
    return sorted(files), sorted(skipped)


def folder_listing(root) -> Listing:
    """Every UTF-8 text file under the folder `root` (see the module
    docstring). A folder without one is refused, naming it."""
    root = os.fspath(root)
    files, skipped = folder_entries(root)
    found, binary = [], []
    for rel in files:
        try:
            got = read_regular(os.path.join(root, *rel.split("/")), sniff=True)
        except OSError:
            skipped.append(rel)
            continue
        if got is None:  # replaced by something else since it was listed
            skipped.append(rel)
            continue
        body, mtime_ns = got
        if body is None or b"\0" in body:
            binary.append(rel)
            continue
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            binary.append(rel)
            continue
        found.append((rel, _with_newline(text), mtime_ns, len(body)))
    name = os.path.basename(os.path.normpath(os.path.abspath(root))) or "root"
    listing = Listing(FOLDER, root, name, binary=binary, skipped=sorted(skipped))
    if not found:
        raise StreamError(f"source {root}: a folder with no text file to train on "
                          f"({listing.summary()}; hidden entries are not read)")
    return _ordered(listing, found)


def file_listing(path) -> Listing:
    """One file, one document, its text as it is (UTF-8, newlines kept)."""
    path = os.fspath(path)
    try:
        got = read_regular(path, follow=True)  # named by the user: a link to a file is fine
    except FileNotFoundError:
        raise StreamError(f"source {path}: no such file") from None
    except OSError as e:
        raise _fs_error(f"source {path}: cannot read", e) from None
    if got is None:
        raise StreamError(f"source {path}: not a regular file or a folder")
    body, mtime_ns = got
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StreamError(f"source {path}: not UTF-8 at byte offset {e.start}") from None
    name = os.path.splitext(os.path.basename(path))[0]
    return _ordered(Listing(FILE, path, name), [(os.path.basename(path), text, mtime_ns,
                                                 len(body))])


def list_source(source=None) -> Listing:
    """The Listing of a source: None for the embedded corpus, else a folder
    or a file path. Anything else is refused, naming it."""
    if source is None:
        return embedded_listing()
    source = os.fspath(source)
    try:
        st = os.stat(source)
    except FileNotFoundError:
        raise StreamError(f"source {source}: no such file or folder") from None
    except OSError as e:
        raise _fs_error(f"source {source}: cannot read", e) from None
    if stat.S_ISDIR(st.st_mode):
        return folder_listing(source)
    if not stat.S_ISREG(st.st_mode):
        raise StreamError(f"source {source}: not a regular file or a folder")
    return file_listing(source)
