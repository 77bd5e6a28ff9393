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
  marker line could not hold them; the list of skipped entries shows each
  such byte as `\\xNN`);
- a regular file is binary, skipped and counted, when it holds a NUL byte
  or its bytes are not UTF-8. The listing reads every file through, so the
  rule is exact rather than a guess from a prefix; the first 8 KiB are
  looked at first, so most binary files are turned down without reading
  the rest of them.

Bounded memory (SPEC 22). A listing holds its documents' names, paths and
sizes, never their text: `iter_chunks` reads the source text again, a block
of at most BLOCK_BYTES at a time (decoded as it comes), and `iter_documents`
a document at a time. A document that changed since it was listed (its
size, or bytes that are no longer text) stops the reading with an error
that says so, rather than give a stream that matches neither version.

The embedded corpus keeps its version-1 reading: every `.py` file is a
document, invalid UTF-8 replaced by U+FFFD, so the list is the same on every
machine with the same Python; a file the process may not read is left out.

A listing's stamp is the newest document's modification time (ns) and the
documents' total size in bytes: the stream header's two fields.

Structured sources (SPEC 22): a `.jsonl` file (also `.jsonl.gz`, `.jsonl.zst`)
holds one JSON object per line, a `.parquet` file a string column; each
record's text field (`text`, or the one named) is a document. Such a file,
or a folder holding any, is a listing of kind RECORDS: its files are taken
in sorted relative-path order and shuffled by section 8's key like a
folder's documents, and each file's records keep their order within it;
other files of such a folder are skipped and counted. Records are read as
a stream (compressed files decompressed on the fly, Parquet by row group),
never held whole: iter_documents yields them one at a time. A record's text
is used as it is (no marker line).
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import os
import platform
import zlib
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
SNIFF_BYTES = 8192  # the prefix looked at for a NUL before reading the rest
BLOCK_BYTES = 1 << 20  # what is read of a text file at a time
MARKER = "# file: {}\n"

EMBEDDED, FOLDER, FILE, RECORDS = "embedded", "folder", "file", "records"
TEXT_FIELD = "text"  # a record's document, unless --text-field names another
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIX = ".parquet"
STRUCTURED_SUFFIXES = JSONL_SUFFIXES + (PARQUET_SUFFIX,)


def is_structured(path) -> bool:
    """Whether a file's name makes it a structured source (JSONL or Parquet)."""
    return os.fspath(path).endswith(STRUCTURED_SUFFIXES)


@dataclass
class Listing:
    """A source's documents, read and ordered.

    documents: relative paths in the keyed order (the order of the text);
    paths, sizes: each document's file and its size in bytes, in the same order;
    binary, skipped: relative paths left out (see the module docstring), sorted."""

    kind: str  # EMBEDDED, FOLDER, FILE or RECORDS
    root: str  # the stdlib folder, the folder or the file
    name: str  # the stem the stream cache names its folder after
    documents: list = field(default_factory=list)
    paths: list = field(default_factory=list)
    sizes: list = field(default_factory=list)
    binary: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    mtime_ns: int = 0  # the newest document's modification time
    size: int = 0  # the documents' total size in bytes
    text_bytes: int = 0  # the UTF-8 bytes of the source text (markers and added newlines too)
    text_field: str = TEXT_FIELD  # RECORDS: the field that is a record's document
    done: int = 0  # RECORDS: bytes of its files read so far by iter_documents

    @property
    def stamp(self) -> tuple:
        """(mtime_ns, size): what the stream header records."""
        return self.mtime_ns, self.size

    def text(self) -> str:
        """The source text: the documents in the keyed order, each behind its
        marker line (a single file: its text as it is). Whole, in memory:
        iter_chunks gives it in bounded pieces."""
        return "".join(self.iter_chunks())

    def iter_chunks(self):
        """The source text (text()) in chunks, none longer than BLOCK_BYTES
        characters, read from the files as they are yielded."""
        for i in range(len(self.documents)):
            yield from self.document_chunks(i)

    def document_chunks(self, i: int):
        """Document i's text in chunks: behind its marker line and ending
        with a newline (an empty document: its marker alone), but for a
        single file, whose text is as it is."""
        marked = self.kind != FILE
        if marked:
            yield MARKER.format(self.documents[i])
        last = ""
        for text in read_text(self.paths[i], self.kind, self.sizes[i]):
            last = text[-1]
            yield text
        if marked and last not in ("", "\n"):
            yield "\n"

    def summary(self) -> str:
        """'1,234 documents, 2 binary files skipped' for the command line."""
        if self.kind == RECORDS:
            text = f"{len(self.documents):,} file{'s' if len(self.documents) != 1 else ''} of records"
            if self.skipped:
                text += f", {len(self.skipped):,} other entr" \
                        f"{'ies' if len(self.skipped) != 1 else 'y'} skipped"
            return text
        return summary(len(self.documents), len(self.binary), len(self.skipped))

    def iter_documents(self):
        """The documents' texts in the order of the stream, one at a time
        (each whole in memory): a record's text as it is; a file of text, or
        a folder's or the embedded corpus's document behind its marker line
        (document_chunks). For RECORDS,
        `done` counts the bytes of the files read so far (for progress)."""
        if self.kind != RECORDS:
            for i in range(len(self.documents)):
                yield "".join(self.document_chunks(i))
        else:
            self.done = 0
            for rel in self.documents:
                path = self.root if len(self.documents) == 1 and not os.path.isdir(self.root) \
                    else os.path.join(self.root, *rel.split("/"))
                before = self.done
                for text, position in read_records(path, self.text_field):
                    self.done = before + position
                    yield text
                self.done = before + os.path.getsize(path)


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

def open_regular_file(path, follow: bool = False):
    """A binary file object of the regular file `path`, or None when it is
    anything else: a FIFO, a device, a socket, or (unless `follow`) a
    symbolic link. The file is opened non-blocking and what was opened is
    checked, so a FIFO swapped in after a listing cannot hang the read.
    Raises OSError when the file cannot be opened."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if not follow and os.path.islink(path):  # O_NOFOLLOW's ELOOP: a link, not a file
            return None
        raise
    f = open(fd, "rb")  # owns fd from here
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        return None
    return f


class NotText(Exception):
    """A file that is not text: `why` (a NUL byte, bytes not UTF-8) at byte `offset`."""

    def __init__(self, why: str, offset: int):
        super().__init__(why, offset)
        self.why, self.offset = why, offset


def decoded_blocks(f, errors: str = "strict", nul: bool = False):
    """The text of the open binary file `f`, UTF-8, decoded a block at a
    time (the first SNIFF_BYTES, then BLOCK_BYTES each). NotText at the
    first byte that is not UTF-8 (errors "strict"; "replace" puts U+FFFD
    there) or, with `nul`, at the first NUL byte."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors)
    offset, size = 0, SNIFF_BYTES
    while True:
        block = f.read(size)
        size = BLOCK_BYTES
        if nul and b"\0" in block:
            raise NotText("a NUL byte", offset + block.index(b"\0"))
        held = len(decoder.getstate()[0])  # bytes of a character the last block cut in two
        try:
            text = decoder.decode(block, final=not block)
        except UnicodeDecodeError as e:
            raise NotText("not UTF-8", offset - held + e.start) from None
        offset += len(block)
        if text:
            yield text
        if not block:
            return


# how each kind of source reads its files: (links followed, decoding errors, NUL is binary)
_READING = {EMBEDDED: (True, "replace", False), FOLDER: (False, "strict", True),
            FILE: (True, "strict", False)}


def scan_text(path, kind: str):
    """(size, UTF-8 bytes of its text as a document, mtime_ns) of a file of a
    source of `kind`, read through a block at a time; None when it is not a
    regular file (see open_regular_file). NotText when it is not text (never
    for the embedded corpus, read with replacement); OSError when it cannot
    be read."""
    follow, errors, nul = _READING[kind]
    f = open_regular_file(path, follow=follow)
    if f is None:
        return None
    with f:
        mtime_ns = os.fstat(f.fileno()).st_mtime_ns
        size = text_bytes = 0
        last = ""
        for text in decoded_blocks(f, errors, nul):
            text_bytes += len(text.encode("utf-8")) if errors != "strict" else 0
            last = text[-1]
        size = f.tell()
        if errors == "strict":
            text_bytes = size  # valid UTF-8: its bytes are its text's
        if kind != FILE and last not in ("", "\n"):
            text_bytes += 1  # the newline the document gets
    return size, text_bytes, mtime_ns


def read_text(path, kind: str, size: int):
    """The text of a document listed with `size` bytes, in blocks (decoded_blocks);
    a StreamError when the file is no longer that regular file of text."""
    follow, errors, nul = _READING[kind]

    def changed(why):
        return StreamError(f"source {path}: changed since it was listed ({why}); run again")

    try:
        f = open_regular_file(path, follow=follow)
    except OSError as e:
        raise changed(e.strerror or str(e)) from None
    if f is None:
        raise changed("no longer a regular file")
    with f:
        try:
            yield from decoded_blocks(f, errors, nul)
        except NotText as e:
            raise changed(f"{e.why} at byte offset {e.offset}") from None
        except OSError as e:
            raise changed(e.strerror or str(e)) from None
        if f.tell() != size:
            raise changed(f"{f.tell():,} bytes, listed with {size:,}")


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
    """Fill `listing` from `found` [(rel, path, size, text bytes, mtime_ns)] sorted by rel."""
    for i in keyed_order(len(found)):
        rel, path, size, text_bytes, _ = found[i]
        listing.documents.append(rel)
        listing.paths.append(path)
        listing.sizes.append(size)
        if listing.kind in (EMBEDDED, FOLDER):
            text_bytes += len(MARKER.format(rel).encode("utf-8"))
        listing.text_bytes += text_bytes
    listing.mtime_ns = max((m for *_, m in found), default=0)
    listing.size = sum(size for _, _, size, _, _ in found)
    return listing


def embedded_listing(root: str | None = None) -> Listing:
    """The embedded default source (see the module docstring)."""
    root = root or stdlib_root()
    found = []
    for rel in stdlib_files(root):
        path = os.path.join(root, *rel.split("/"))
        try:
            # links followed, as version 1 read the stdlib (a distribution may
            # link a module to a file elsewhere)
            got = scan_text(path, EMBEDDED)
        except OSError:
            continue  # unreadable on this machine (permissions): not part of the corpus
        if got is not None:
            found.append((rel, path, *got))
    return _ordered(Listing(EMBEDDED, root, default_source_name()), found)


def shown_name(rel: str) -> str:
    """A relative path whose bytes are not UTF-8 as text that is: each such
    byte as `\\xNN` (what the document list records of a skipped name)."""
    return os.fsencode(rel).decode("utf-8", "backslashreplace")


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
                skipped.append(shown_name(rel))
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
        path = os.path.join(root, *rel.split("/"))
        try:
            got = scan_text(path, FOLDER)
        except NotText:
            binary.append(rel)
            continue
        except OSError:
            skipped.append(rel)
            continue
        if got is None:  # replaced by something else since it was listed
            skipped.append(rel)
            continue
        found.append((rel, path, *got))
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
        got = scan_text(path, FILE)  # named by the user: a link to a file is fine
    except FileNotFoundError:
        raise StreamError(f"source {path}: no such file") from None
    except NotText as e:
        raise StreamError(f"source {path}: {e.why} at byte offset {e.offset}") from None
    except OSError as e:
        raise _fs_error(f"source {path}: cannot read", e) from None
    if got is None:
        raise StreamError(f"source {path}: not a regular file or a folder")
    name = os.path.splitext(os.path.basename(path))[0]
    return _ordered(Listing(FILE, path, name), [(os.path.basename(path), path, *got)])


# ---------------------------------------------------------------------------
# Structured sources: JSONL and Parquet records

def _record_error(path, where: str, why: str) -> StreamError:
    return StreamError(f"source {os.fspath(path)}: {where}: {why}")


def _open_bytes(path):
    """A binary stream of the file's bytes (decompressed for .gz / .zst) and
    the raw file under it, whose position says how far the file is read."""
    raw = open(path, "rb")
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if path.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw)), raw
    return raw, raw


def _jsonl_records(path: str, field_name: str):
    """(text, raw bytes read) of each line of a JSONL file, in order."""
    try:
        import zstandard

        corrupt = (OSError, EOFError, zlib.error, zstandard.ZstdError)
    except ImportError:
        corrupt = (OSError, EOFError, zlib.error)
    try:
        f, raw = _open_bytes(path)
    except OSError as e:
        raise _fs_error(f"source {path}: cannot read", e) from None
    with raw, f:
        number = 0
        while True:
            try:
                line = f.readline()
            except corrupt as e:
                raise _record_error(path, f"line {number + 1}",
                                    f"cannot decompress ({e})") from None
            if not line:
                return
            number += 1
            try:
                record = json.loads(line)
            except ValueError as e:
                raise _record_error(path, f"line {number}", f"not JSON ({e})") from None
            if not isinstance(record, dict):
                raise _record_error(path, f"line {number}",
                                    f"not a JSON object (a {type(record).__name__})")
            if field_name not in record:
                raise _record_error(path, f"line {number}", f"no field {field_name!r}")
            text = record[field_name]
            if not isinstance(text, str):
                raise _record_error(path, f"line {number}",
                                    f"field {field_name!r} is not a string "
                                    f"(a {type(text).__name__})")
            yield text, raw.tell()


def _parquet_records(path: str, field_name: str):
    """(text, bytes read so far) of each row of a Parquet file's string
    column, read one row group at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise _record_error(path, "not a Parquet file", str(e).splitlines()[0]) from None
    schema = pf.schema_arrow
    if field_name not in schema.names:
        raise _record_error(path, f"column {field_name!r}",
                            f"no such column (it has {', '.join(schema.names) or 'none'})")
    kind = schema.field(field_name).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise _record_error(path, f"column {field_name!r}", f"not a string column ({kind})")
    size = os.path.getsize(path)
    groups = pf.metadata.num_row_groups
    row = 0
    for g in range(groups):
        try:
            column = pf.read_row_group(g, columns=[field_name]).column(0)
        except (OSError, pa.ArrowException) as e:
            raise _record_error(path, f"row group {g}", str(e).splitlines()[0]) from None
        position = size * (g + 1) // groups
        for text in column.to_pylist():
            if text is None:
                raise _record_error(path, f"row {row}", f"column {field_name!r} is null")
            row += 1
            yield text, position
        del column


def read_records(path, field_name: str = TEXT_FIELD):
    """(text, bytes of the file read so far) of each record of a structured
    file, in the file's order. A record that is not an object with the
    string field, bad JSON, a corrupt compressed file or a column that is
    not a string column is a StreamError naming the file and the line (row,
    row group or column)."""
    path = os.fspath(path)
    if path.endswith(PARQUET_SUFFIX):
        return _parquet_records(path, field_name)
    return _jsonl_records(path, field_name)


def records_listing(root: str, files: list, skipped: list, text_field: str) -> Listing:
    """A RECORDS Listing of the structured `files` (relative paths, sorted)
    under the folder `root`, or of the one file `root` (files == [its name])."""
    found = []
    for rel in files:
        path = root if files == [os.path.basename(root)] and not os.path.isdir(root) \
            else os.path.join(root, *rel.split("/"))
        try:
            st = os.stat(path)
        except OSError as e:
            raise _fs_error(f"source {path}: cannot read", e) from None
        found.append((rel, path, st.st_size, 0, st.st_mtime_ns))
    if os.path.isdir(root):
        name = (os.path.basename(os.path.normpath(os.path.abspath(root))) or "root") + "-dir"
    else:
        name = os.path.basename(root)
        for suffix in STRUCTURED_SUFFIXES:
            if name.endswith(suffix):
                name = name[:-len(suffix)]
                break
    return _ordered(Listing(RECORDS, root, name, skipped=sorted(skipped), text_field=text_field),
                    found)


def list_source(source=None, text_field: str | None = None) -> Listing:
    """The Listing of a source: None for the embedded corpus, else a folder
    or a file path (a structured one, or a folder holding one, gives a
    RECORDS listing of its `text_field`). Anything else is refused, naming it."""
    if source is None:
        return embedded_listing()
    source = os.fspath(source)
    try:
        st = os.stat(source)
    except FileNotFoundError:
        raise StreamError(f"source {source}: no such file or folder") from None
    except OSError as e:
        raise _fs_error(f"source {source}: cannot read", e) from None
    field_name = TEXT_FIELD if text_field is None else text_field
    if stat.S_ISDIR(st.st_mode):
        files, skipped = folder_entries(source)
        structured = [rel for rel in files if is_structured(rel)]
        if structured:
            others = [rel for rel in files if not is_structured(rel)]
            return records_listing(source, structured, skipped + others, field_name)
        return folder_listing(source)
    if not stat.S_ISREG(st.st_mode):
        raise StreamError(f"source {source}: not a regular file or a folder")
    if is_structured(source):
        return records_listing(source, [os.path.basename(source)], [], field_name)
    return file_listing(source)
