"""From a source to a token stream (SPEC section 8): the stream cache, the
document list and digest beside a stream, and their publication. The
tokenizer that encodes the source is coppelius.tokenizer's; the
`coppelius tokenize` subcommand is coppelius.tokenize.

A source (the embedded corpus, a folder or a file) is a list of documents,
concatenated in the keyed order: coppelius.corpus reads and orders them.

Cache layout under a cache directory (by default the user's cache,
`$COPPELIUS_CACHE`, else `$XDG_CACHE_HOME/coppelius`, else
`~/.cache/coppelius`: one cache for every working folder, shared by
`coppelius tokenize` and `coppelius train`):

    <entry>/<entry>.tokens           the stream
    <entry>/tokenizer.json           its tokenizer
    <entry>/<entry>.documents.json   its documents, in the keyed order

where <entry> is `<stem>-v<V>-<key>`: <stem> is stdlib-<python version> for
the embedded corpus, the file's stem for a file, and the folder's name
followed by `-dir` for a folder (for the reader); <key> is the first 16 hex
digits of the SHA-256 of the source's identity: its kind, the digest of its
documents' texts in the keyed order, V, and the tokenizer settings (a given
tokenizer's SHA-256, --eos, --text-field). Two folders of one name hold
their own entries; the same documents from another working folder (or a
copy of the folder) find the entry already made.

A folder holds one stream, because its tokenizer is named `tokenizer.json`:
writing a stream into a folder that holds another is refused. A cached stream
is reused only when
- its header holds the source's current stamp (the newest document's mtime in
  ns, the documents' total size),
- the document list beside it names the same kind of source and the same
  documents in the same order (a renamed, added or deleted document changes
  the order, even where it leaves the newest mtime and the total size as
  they were),
- a tokenizer of V ids lies beside it and encodes the first and last pieces
  of the source text to the stream's first and last ids (so a stream is never
  trusted beside another stream's tokenizer),
- the SHA-256 of its ids is the one recorded beside it when it was written
  (`<stream>.sha256`: an id changed anywhere in the middle is noticed);
otherwise it is rebuilt. The stream is locked while it is checked and
rebuilt: a second process waits for the first (with a note).

Only regular files are read (a FIFO or a device given as a source, found in
a folder, or put where a stream's tokenizer, digest or document list goes is
refused or skipped, never opened), and an existing file at the stream's path
is replaced only when it is a token stream. A stream is never written where
it would replace or change its source (a file of it, or inside its folder).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import sys
import time

import numpy as np

from coppelius.corpus import (EMBEDDED, FILE, FOLDER, RECORDS, Listing, list_source, shown_name,
                              summary)
from coppelius.reference.errors import ConfigError, InUseError, StreamError
from coppelius.reference.fsutil import (Lock, kind, open_regular, output_target, publish,
                                        remove_stale, same_file, stage)
from coppelius.reference.stream import (HEADER, HEADER_BYTES, TOKEN, TOKEN_BYTES, open_stream,
                                        read_stream_header, stream_body)
from coppelius.tokenizer import (ENCODE_PIECES, PIECE_CHARS, TOKENIZER_NAME, check_vocab, fs_error,
                                 given_tokenizer, load_tokenizer, pieces, separator, stream_pieces,
                                 tokenizer_beside, tokenizer_sha, train_tokenizer)

STREAM_SUFFIX = ".tokens"
DIGEST_SUFFIX = ".sha256"  # beside a cached stream: the SHA-256 of its ids
# The streaming tokenizer (documents with a separator, structured sources)
# encodes batches of at most BATCH_CHARS characters or BATCH_DOCUMENTS
# documents: what it holds at once, whatever the size of the corpus.
BATCH_CHARS = 1 << 20
BATCH_DOCUMENTS = 4096

CACHE_ENV = "COPPELIUS_CACHE"  # moves the stream cache (a folder; made when first needed)


def default_cache_dir() -> str:
    """The user's stream cache, one for every working folder: $COPPELIUS_CACHE,
    else $XDG_CACHE_HOME/coppelius (an absolute XDG_CACHE_HOME only, as the
    XDG base directory specification says), else ~/.cache/coppelius."""
    moved = os.environ.get(CACHE_ENV)
    if moved:
        return os.path.abspath(moved)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "coppelius")


DOCUMENTS_DIGEST = "coppelius-documents-sha256-v1"


def documents_digest(listing: Listing) -> str:
    """The SHA-256 of a source's documents: its kind, then each document's
    text (as iter_documents yields it, in the keyed order) behind its length
    in UTF-8 bytes. Equal for the same documents wherever they lie and
    whatever their modification times; a renamed document changes it (its
    marker line is part of its text)."""
    h = hashlib.sha256(f"{DOCUMENTS_DIGEST}|{listing.kind}|{listing.text_field}\n".encode())
    for text in listing.iter_documents():
        body = text.encode("utf-8", "surrogatepass")
        h.update(len(body).to_bytes(8, "little"))
        h.update(body)
    return h.hexdigest()


def cache_key(digest: str, vocab: int, tokenizer_text: str | None, eos: str | None,
              text_field: str | None) -> str:
    """The cache entry's key: the source's documents (their digest) and every
    setting that changes the ids made of them."""
    def named(value):
        return "none" if value is None else _short_hash(value, 64)

    parts = [DOCUMENTS_DIGEST, digest, f"vocab={vocab}",
             "tokenizer=" + ("trained" if tokenizer_text is None else named(tokenizer_text)),
             "eos=" + named(eos), "text_field=" + named(text_field)]
    return _short_hash("|".join(parts), 16)


def head_and_tail(text) -> tuple:
    """The first piece of `text` (a string, or an iterable of the strings
    that make it) and its last piece (stream_pieces), each cut where the
    pre-tokenizer splits anyway, so each encodes to the first / last ids of
    the whole text's encoding. The tail is empty when the head is the whole
    text. The text is read through once, a piece at a time."""
    head = tail = None
    for piece in stream_pieces([text] if isinstance(text, str) else text):
        if head is None:
            head = piece
        else:
            tail = piece
    return head or "", tail or ""


def encodes_to(tokenizer, text, ids: np.ndarray) -> bool:
    """Whether `tokenizer` turns the head and the tail of `text` (a string,
    or an iterable of its chunks) into the first and last ids of `ids` (N,).
    A tokenizer trained on another source, or with another V, encodes them
    otherwise: this pairs a stream with the tokenizer that made it without
    storing anything beyond SPEC's files, at the cost of reading the text
    through and encoding two pieces."""
    for piece, at_end in zip(head_and_tail(text), (False, True)):
        want = np.array(tokenizer.encode(piece, add_special_tokens=False).ids, dtype=np.uint32)
        if want.size > ids.size:
            return False
        got = ids[ids.size - want.size:] if at_end else ids[:want.size]
        if not np.array_equal(got, want):
            return False
    return True


def digest_beside(stream_path) -> str:
    """The digest of its ids published beside a stream: `a.tokens` -> `a.tokens.sha256`."""
    return os.fspath(stream_path) + DIGEST_SUFFIX


def read_digest(stream_path) -> str | None:
    """The SHA-256 of its ids recorded beside a cached stream, or None."""
    try:
        with open_regular(digest_beside(stream_path)) as f:
            text = f.read(100).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if len(text) == 64 else None


DOCUMENTS_FORMAT = "coppelius-documents-v1"


def documents_beside(stream_path) -> str:
    """The document list published beside a stream: `a.tokens` -> `a.documents.json`."""
    return os.path.splitext(os.fspath(stream_path))[0] + ".documents.json"


def documents_record(listing: Listing, streamed: dict | None = None,
                     digest: str | None = None) -> dict:
    """What the document list beside a stream holds: the kind of source, its
    documents in the keyed order, and what was skipped (for the summaries).
    A stream written document by document (tokenize_documents) records
    `streamed` too: its separator, the records' field and its tokenizer's
    SHA-256, which pair it with its source and tokenizer."""
    record = {"format": DOCUMENTS_FORMAT, "kind": listing.kind,
              "documents": [shown_name(rel) for rel in listing.documents],  # a file's, maybe not UTF-8
              "binary": listing.binary, "skipped": listing.skipped}
    if streamed is not None:
        record.update(streamed)
    if digest is not None:  # a cache entry's: the documents' digest it is keyed by
        record["digest"] = digest
    return record


def read_documents(stream_path) -> dict | None:
    """The document list beside a stream, or None where there is none, it is
    not a regular file (never opened then), or it is not one this version
    writes (a cache entry that is then rebuilt)."""
    path = documents_beside(stream_path)
    try:
        with open_regular(path) as f:  # a FIFO put there is refused, never opened
            record = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not (isinstance(record, dict) and record.get("format") == DOCUMENTS_FORMAT
            and all(isinstance(record.get(k), list) for k in ("documents", "binary", "skipped"))):
        return None
    return record


def documents_summary(stream_path) -> str | None:
    """'12 documents, 3 binary files skipped' from the list beside a stream,
    or None where there is none (a stream given as it is)."""
    record = read_documents(stream_path)
    if record is None:
        return None
    return summary(len(record["documents"]), len(record["binary"]), len(record["skipped"]))


def is_fresh(stream_path, source, vocab: int, given: str | None = None,
             streamed: dict | None = None, digest: str | None = None) -> bool:
    """Whether the cached stream was made from the source as it is now, by
    the tokenizer of `vocab` ids that lies beside it (or, `given` the text of
    a --tokenizer file, by that one, byte for byte). `source`: a Listing,
    or what list_source takes (None for the embedded corpus, a path).
    `streamed`: a stream written document by document, with that separator
    and field (its record names its tokenizer's SHA-256). `digest`: the
    documents' digest of a cache entry; a list recording it stands for the
    stamp (the same documents copied elsewhere, with other mtimes)."""
    listing = source if isinstance(source, Listing) else list_source(source)
    try:
        header = read_stream_header(stream_path)
        record = read_documents(stream_path)
        if record is None or (record["kind"], record["documents"]) != (
                listing.kind, documents_record(listing)["documents"]):
            return False
        if header != listing.stamp and (digest is None or record.get("digest") != digest):
            return False
        if streamed is not None:
            if any(record.get(k) != v for k, v in streamed.items()):
                return False
            if record.get("tokenizer") != tokenizer_sha(tokenizer_beside(stream_path)):
                return False
        elif "tokenizer" in record:
            return False
        tokenizer_path = tokenizer_beside(stream_path)
        if not os.path.isfile(tokenizer_path):
            return False
        tokenizer = load_tokenizer(tokenizer_path)
        if given is not None:
            with open_regular(tokenizer_path) as f:
                if f.read().decode("utf-8", "replace") != given:
                    return False
        elif tokenizer.get_vocab_size() != vocab:
            return False
        stream = open_stream(stream_path, vocab)
        try:
            if stream.sha256 != read_digest(stream_path):
                return False
            return streamed is not None or encodes_to(tokenizer, listing.iter_chunks(), stream.ids)
        finally:
            stream.close()
    except StreamError:
        return False


def documents_body(listing: Listing, record: dict | None = None) -> bytes:
    """The document list's file: `record` (default documents_record(listing)) as JSON."""
    record = documents_record(listing) if record is None else record
    return (json.dumps(record, indent=1, ensure_ascii=False) + "\n").encode("utf-8")


def publish_documents(stream_path, listing: Listing, record: dict | None = None) -> None:
    path = documents_beside(stream_path)
    body = documents_body(listing, record)
    try:
        publish(path, lambda f: f.write(body))
    except OSError as e:
        raise fs_error(f"document list {path}: cannot write", path, e) from None


def check_can_write(stream_path) -> None:
    """Refuse a stream whose folder cannot be made or written, before the
    tokenizer is trained (a minute on the embedded corpus), and without
    making anything: its nearest existing ancestor must be a writable folder."""
    stream_path = os.fspath(stream_path)
    probe = os.path.dirname(os.path.abspath(stream_path))
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    reason = ("Not a directory" if not os.path.isdir(probe) else
              "Permission denied" if not os.access(probe, os.W_OK | os.X_OK) else None)
    if reason:
        raise StreamError(f"stream {stream_path}: cannot write ({reason} at {probe})")


def check_folder_is_its_own(stream_path) -> None:
    """Refuse to write a stream into a folder that holds another one: the
    two would share one tokenizer.json, and writing this stream's would pair
    the other with a tokenizer that did not make it."""
    stream_path = os.fspath(stream_path)
    directory = os.path.dirname(stream_path)
    try:
        names = os.listdir(directory or ".")
    except (FileNotFoundError, NotADirectoryError):
        return  # no folder yet: nothing to share (writing says why it cannot make one)
    except OSError as e:
        raise fs_error(f"stream {stream_path}: cannot list its folder", directory or ".", e) from None
    others = sorted(n for n in names if n.endswith(STREAM_SUFFIX) and not n.startswith(".")
                    and n != os.path.basename(stream_path))
    if others:
        raise StreamError(f"stream {stream_path}: its folder already holds the stream "
                          f"{os.path.join(directory, others[0])}, whose {TOKENIZER_NAME} would "
                          f"be replaced; write each stream to a folder of its own")


def ids_sha256(ids: np.ndarray) -> str:
    """Hex SHA-256 of ids (N,) as a stream stores them (Stream.sha256)."""
    body = np.ascontiguousarray(ids, dtype="<u4")
    h = hashlib.sha256()
    for start in range(0, body.size, 1 << 22):
        h.update(body[start:start + (1 << 22)].tobytes())
    return h.hexdigest()


def publish_pair(stream_path, ids: np.ndarray | None, mtime_ns: int, size: int,
                 tokenizer_json: str, listing: Listing | None = None,
                 write_ids=None, record: dict | None = None) -> str:
    """Publish a stream of `ids` (N,), its tokenizer.json, the digest of its
    ids and (given the source's `listing`) its document list -> the
    tokenizer path. With `write_ids` instead of `ids`, the ids are written
    as they come: `write_ids(f)` writes them to the temporary and returns
    their SHA-256; the header is written at the end. `record`: the
    document list to publish (default documents_record(listing)).

    Every file is written and synced to a temporary first, so that a
    failure while writing (a full disk, a name that cannot be recorded)
    changes nothing and leaves nothing, not even the folder made for them.
    Files cannot be renamed at once, so the order of the renames is chosen
    for what a crash between them leaves behind:

      1. the tokenizer is renamed over its path;
      2. the stream;
      3. the document list;
      4. the digest of the new ids.

    A crash between 1 and 2 leaves the new tokenizer beside the old stream,
    and is_fresh turns that pair down, so the next run rebuilds it: the old
    header names an older source, or the new tokenizer does not encode the
    source to the old ids.
    (It is accepted only where it is a true pair: the same source and V
    train the same tokenizer, byte for byte, and the same ids.) At no point
    is the old stream left without a tokenizer. The list and the digest come
    after the stream because each is what tells a changed stream apart (a
    renamed document leaves the header as it was; an id changed in the
    middle leaves the head and the tail): a crash after 2 leaves the old list
    or the old digest beside the new stream, which is_fresh turns down; the
    other order could leave the new ones beside the old stream and have it
    accepted."""
    stream_path = os.fspath(stream_path)
    tokenizer_path = tokenizer_beside(stream_path)
    digest_path = digest_beside(stream_path)
    documents_path = documents_beside(stream_path)
    directory = os.path.dirname(os.path.abspath(stream_path))
    made = missing_folders(directory)
    staged = {}  # what -> (path, its Staged temporary), in the order of the renames
    what, path = "stream", stream_path
    try:
        os.makedirs(directory, exist_ok=True)
        digest = None
        if write_ids is None:
            stream_file = stage(stream_path, stream_body(ids, mtime_ns, size, stream_path))
        else:
            def write_body(f):
                nonlocal digest
                f.write(bytes(HEADER_BYTES))  # a placeholder, until every id is written
                digest = write_ids(f)
                f.seek(0)
                f.write(stream_header(mtime_ns, size))
                f.seek(0, os.SEEK_END)

            stream_file = stage(stream_path, write_body)
        bodies = {"tokenizer": (tokenizer_path, tokenizer_json.encode("utf-8"))}
        staged["stream"] = (stream_path, stream_file)
        if listing is not None:  # its count is known once the ids are written
            bodies["document list"] = (documents_path, documents_body(listing, record))
        bodies["stream digest"] = (digest_path,
                                   ((digest or ids_sha256(ids)) + "\n").encode("ascii"))
        for what, (path, body) in bodies.items():
            staged[what] = (path, stage(path, lambda f, body=body: f.write(body)))
        for what in ("tokenizer", "stream", "document list", "stream digest"):  # 1 to 4
            if what in staged:
                path, file = staged[what]
                file.commit()
    except OSError as e:
        raise fs_error(f"{what} {path}: cannot write", path, e) from None
    finally:
        for _, file in staged.values():
            file.discard()  # those not renamed
        remove_made(made)
    return tokenizer_path


def missing_folders(directory: str) -> list:
    """The folders that making `directory` would create, deepest first."""
    made = []
    while directory and not os.path.lexists(directory):
        made.append(directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    return made


def remove_made(made: list) -> None:
    """Remove the folders of `made` (missing_folders) that are still empty:
    a publication that failed leaves no folder it made either."""
    for directory in made:
        try:
            os.rmdir(directory)
        except OSError:
            return  # not empty (published into), or gone: the ones above stay too


def stream_header(mtime_ns: int, size: int) -> bytes:
    """A stream's 16-byte header (SPEC 8)."""
    return np.array([(mtime_ns, size)], dtype=HEADER).tobytes()


def document_parts(listing: Listing, own: bool):
    """(text, ends a document?) of each part of the source's documents, in
    the stream's order. With the project's own BPE (`own`), a document of
    text is read in the pieces stream_pieces cuts from it, which encode as
    the whole document does (so a document is never held whole); with a
    given tokenizer, whose pre-tokenizer may split otherwise, each document
    is one part; a record is read whole (it is one line or row), and cut
    into pieces for the own BPE."""
    if not own or listing.kind == RECORDS:
        for text in listing.iter_documents():
            if own and len(text) > PIECE_CHARS:  # a long record of the own BPE: in its pieces
                *rest, last = pieces(text)
                for piece in rest:
                    yield piece, False
                text = last
            yield text, True
        return
    for i in range(len(listing.documents)):
        last = None
        for piece in stream_pieces(listing.document_chunks(i)):
            if last is not None:
                yield last, False
            last = piece
        yield last or "", True


def document_batches(parts, size: int | None = None):
    """Lists of consecutive parts of `parts` (an iterator of (text, ends a
    document?), document_parts), each of at most BATCH_DOCUMENTS parts and,
    but for a single long part, about BATCH_CHARS characters."""
    size = size or BATCH_CHARS
    batch, chars = [], 0
    for part in parts:
        batch.append(part)
        chars += len(part[0])
        if chars >= size or len(batch) >= BATCH_DOCUMENTS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def tokenize_documents(listing: Listing, stream_path, vocab: int, progress: bool = False,
                       given: tuple | None = None, eos: str | None = None,
                       streamed: dict | None = None, digest: str | None = None) -> dict:
    """Tokenize a source document by document, in bounded memory (SPEC 22):
    train the BPE from an iterator of its documents (or take `given`), then
    encode batches of documents with the batch encoder (every core), each
    document followed by the separator (`eos`, see separator), writing the
    ids to the stream's temporary as they come; publish_pair then publishes
    the stream with its tokenizer, document list and digest. An exception
    midway (an interrupt, a bad record) removes the temporary: nothing
    published changes."""
    from tqdm import tqdm

    started = time.perf_counter()
    if given is None:
        if progress:
            print(f"training a byte-level BPE of {vocab} ids on {describe(listing)} "
                  f"({listing.summary()}, {listing.size:,} bytes)", file=sys.stderr)
        tokenizer = train_tokenizer((piece for piece, _ in document_parts(listing, True)), vocab,
                                    name=listing.root, eos=eos)
        tokenizer_text = tokenizer.to_str()
        given_path = None
    else:
        tokenizer, tokenizer_text = given[:2]
        given_path = given[2] if len(given) > 2 else None
    sep = separator(tokenizer, eos, given_path, listing)
    tail = np.array([] if sep is None else [sep[1]], dtype=TOKEN)
    batch_encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets
    own = given is None  # the project's BPE: a long document may be encoded in pieces (exact)
    counts = {"documents": 0, "ids": 0}

    def write_ids(f):
        h = hashlib.sha256()
        with tqdm(total=listing.size, unit="B", unit_scale=True, desc="tokenizing",
                  disable=not progress, leave=False, file=sys.stderr) as bar:
            seen = 0
            for batch in document_batches(document_parts(listing, own)):
                texts = [text for text, _ in batch]
                seen += sum(map(len, texts))  # characters: about the bytes where records are read
                encodings = batch_encode(texts, add_special_tokens=False)
                chunks = []
                for encoding, (_, ends) in zip(encodings, batch):
                    chunks.append(np.array(encoding.ids, dtype=TOKEN))
                    if ends:
                        chunks.append(tail)  # the end of a document
                        counts["documents"] += 1
                del encodings
                body = np.concatenate(chunks).astype(TOKEN, copy=False).tobytes()
                f.write(body)
                h.update(body)
                counts["ids"] += len(body) // TOKEN_BYTES
                done = listing.done if listing.kind == RECORDS else min(seen, listing.size)
                bar.update(max(done - bar.n, 0))
                rate = counts["ids"] / max(time.perf_counter() - started, 1e-9)
                bar.set_postfix_str(f"{counts['documents']:,} documents, {rate:,.0f} ids/s")
        record["count"] = counts["documents"]  # published after the stream (publish_pair)
        return h.hexdigest()

    record = documents_record(listing, dict(streamed or {}, tokenizer=hashlib.sha256(
        tokenizer_text.encode("utf-8")).hexdigest()), digest=digest)
    tokenizer_path = publish_pair(stream_path, None, listing.mtime_ns, listing.size,
                                  tokenizer_text, listing, write_ids=write_ids, record=record)
    return {"stream": os.fspath(stream_path), "tokenizer": tokenizer_path, "ids": counts["ids"],
            "documents": counts["documents"], "separator": sep and sep[0],
            "seconds": time.perf_counter() - started}


def describe(listing: Listing) -> str:
    """How a source is named in messages."""
    if listing.kind == EMBEDDED:
        return f"the embedded corpus {listing.root}"
    return f"{'folder' if listing.kind == FOLDER else 'source'} {listing.root}"


def tokenize_source(listing: Listing, stream_path, vocab: int, progress: bool = False,
                    given: tuple | None = None, digest: str | None = None) -> dict:
    """Train the tokenizer on the source text (or take `given`, a
    (tokenizer, its file's text) pair), encode the text, publish the stream,
    its tokenizer.json and its document list (publish_pair). Returns what
    was written.

    In bounded memory (SPEC 22): the text is read from the files as it is
    trained on and again as it is encoded, in the pieces stream_pieces cuts
    (the pieces encode() would cut from the whole text, so the ids are the
    same), ENCODE_PIECES at a time, and the ids are written to the stream's
    temporary as they come."""
    from tqdm import tqdm

    started = time.perf_counter()
    if given is None:
        # a vocabulary the source text cannot yield: refused before the library sees it
        check_vocab(vocab, listing.text_bytes)
        if progress:
            print(f"training a byte-level BPE of {vocab} ids on {describe(listing)} "
                  f"({listing.summary()}, {listing.size:,} bytes)", file=sys.stderr)
        tokenizer = train_tokenizer(stream_pieces(listing.iter_chunks()), vocab, name=listing.root)
        tokenizer_text = tokenizer.to_str()
    else:
        tokenizer, tokenizer_text = given[:2]
    batch_encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets
    count = [0]

    def write_ids(f):
        h = hashlib.sha256()
        group = []
        with tqdm(total=listing.text_bytes, unit="B", unit_scale=True, desc="encoding",
                  disable=not progress, leave=False, file=sys.stderr) as bar:
            def flush():
                for encoding in batch_encode(group, add_special_tokens=False):
                    body = np.array(encoding.ids, dtype=TOKEN).tobytes()
                    f.write(body)
                    h.update(body)
                    count[0] += len(body) // TOKEN_BYTES
                bar.update(sum(map(len, group)))
                group.clear()

            for piece in stream_pieces(listing.iter_chunks()):
                group.append(piece)
                if len(group) == ENCODE_PIECES:
                    flush()
            if group:
                flush()
        return h.hexdigest()

    tokenizer_path = publish_pair(stream_path, None, listing.mtime_ns, listing.size,
                                  tokenizer_text, listing, write_ids=write_ids,
                                  record=documents_record(listing, digest=digest))
    return {"stream": os.fspath(stream_path), "tokenizer": tokenizer_path, "ids": count[0],
            "seconds": time.perf_counter() - started}


def prepare_stream(*, source=None, stream=None, vocab: int, out=None, cache_dir=None,
                   progress: bool = False, tokenizer=None, eos: str | None = None,
                   text_field: str | None = None) -> tuple:
    """The stream a run reads -> (stream path, tokenizer path or None).

    With `stream`, use it as is (with the tokenizer.json beside it, if any).
    Otherwise tokenize `source` (a file or a folder; the embedded default when
    None) into `out` (default the cache entry of the source's identity,
    `<cache_dir>/<stem>-v<vocab>-<key>/<stem>-v<vocab>-<key>.tokens`, cache_dir
    None meaning default_cache_dir(); see cache_key), reusing a fresh cached
    stream and rebuilding a stale one. `tokenizer` (--tokenizer, SPEC 22: a
    tokenizer.json or a directory holding one) encodes the source instead of
    a BPE trained on it (its SHA-256 is part of the key), with a copy of it
    beside the stream. `eos` (--eos) and `text_field` (--text-field):
    see tokenize_documents and coppelius.corpus."""
    if stream is not None:
        if source is not None:
            raise ConfigError("give a source or a stream, not both")
        if tokenizer is not None:
            raise ConfigError(f"--tokenizer {os.fspath(tokenizer)}: encodes a --source; a "
                              f"--stream is encoded already (its tokenizer is the "
                              f"{TOKENIZER_NAME} beside it)")
        from coppelius import shards  # llm.c and nanoGPT shards, folders and globs (SPEC 22)

        stream = os.fspath(stream)
        if not os.path.isdir(stream) and not shards.is_pattern(stream) \
                and not os.path.exists(stream):
            raise StreamError(f"stream {stream}: no such token stream")
        tokenizer_path = shards.tokenizer_place(stream)
        # whatever is there is the stream's tokenizer: checked (not ignored) by its reader
        return stream, tokenizer_path if os.path.lexists(tokenizer_path) else None
    stream, tokenizer_path, _, _ = stream_for_source(source, vocab, out, cache_dir, progress,
                                                     tokenizer, eos, text_field)
    return stream, tokenizer_path


def cache_stem(listing: Listing, vocab: int) -> str:
    """The cache folder's and the stream's name: a folder's gets `-dir`, so
    that a folder `notes` and a file `notes.txt` never share a cache entry."""
    return f"{listing.name}{'-dir' if listing.kind == FOLDER else ''}-v{vocab}"


def check_source_kind(source) -> None:
    """Refuse a named source that is neither a folder nor a regular file (a
    FIFO, a device, a socket), saying what it is, without opening it."""
    if source is None:
        return
    path = os.fspath(source)
    try:
        st = os.stat(path)
    except OSError:
        return  # list_source says why
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise StreamError(f"source {path}: is {kind(st.st_mode)}, not a regular file or a folder")


def _short_hash(text: str, digits: int = 12) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:digits]


def stream_for_source(source, vocab: int, out=None, cache_dir=None,
                      progress: bool = False, tokenizer=None, eos: str | None = None,
                      text_field: str | None = None) -> tuple:
    """prepare_stream's work for a source -> (stream, tokenizer, rebuilt?, Listing)."""
    if eos is not None and not eos:
        raise ConfigError("--eos: an empty token")
    if text_field is not None and not text_field:
        raise ConfigError("--text-field: an empty name")
    given = None if tokenizer is None else given_tokenizer(tokenizer, vocab) + (tokenizer,)
    if given is None:
        check_vocab(vocab)
    cache_dir = os.fspath(default_cache_dir() if cache_dir is None else cache_dir)
    check_source_kind(source)
    # a missing or empty source is refused before anything is written
    listing = list_source(source, text_field)
    if text_field is not None and listing.kind != RECORDS:
        raise ConfigError(f"--text-field {text_field}: names a field of .jsonl or .parquet "
                          f"records; {describe(listing)} holds none")
    # the separator, known before the cache is looked at (the trained BPE has --eos only)
    sep = eos if given is None else (separator(given[0], eos, tokenizer, listing) or (None,))[0]
    streamed = None
    if listing.kind == RECORDS or sep is not None:
        streamed = {"eos": sep}
        if listing.kind == RECORDS:
            streamed["text_field"] = listing.text_field
    digest = None
    if out is None:  # the cache entry of the source's identity
        digest = documents_digest(listing)
        key = cache_key(digest, vocab, given and given[1], eos,
                        listing.text_field if listing.kind == RECORDS else None)
        stem = f"{cache_stem(listing, vocab)}-{key}"
        out = os.path.join(cache_dir, stem, stem + STREAM_SUFFIX)
    out = os.fspath(out)
    if os.path.isdir(out):
        raise StreamError(f"stream {out}: is a directory, not a token stream file")
    check_stream_output(out, listing)
    made = None
    if digest is not None and not os.path.isdir(os.path.dirname(out)):
        made = _make_entry(out)  # its folder made now, so that it is locked from the start
    try:
        with _cache_lock(out):
            rebuilt = _fresh_or_rebuilt(out, listing, vocab, given, eos, streamed, progress,
                                        digest)
    except BaseException:
        if made is not None:  # a refused or failed first build leaves no empty entry
            with contextlib.suppress(OSError):
                os.rmdir(made)
        raise
    return out, tokenizer_beside(out), rebuilt, listing


def _make_entry(out: str) -> str | None:
    """Make a cache entry's folder (and the cache's) -> the entry's folder."""
    folder = os.path.dirname(out)
    check_can_write(out)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise fs_error(f"stream {out}: cannot write", folder, e) from None
    return folder


def _fresh_or_rebuilt(out, listing, vocab, given, eos, streamed, progress, digest) -> bool:
    """Under the stream's lock: reuse a fresh stream or rebuild it -> rebuilt?"""
    for leftover in (out, tokenizer_beside(out), digest_beside(out), documents_beside(out)):
        remove_stale(leftover)  # temporaries of a run killed while it published
    rebuilt = not is_fresh(out, listing, vocab, given and given[1], streamed, digest)
    if rebuilt:
        check_folder_is_its_own(out)
        check_can_write(out)
        check_replaceable(out)
        if streamed is None:
            tokenize_source(listing, out, vocab, progress=progress, given=given, digest=digest)
        else:
            tokenize_documents(listing, out, vocab, progress=progress, given=given, eos=eos,
                               streamed=streamed, digest=digest)
    elif streamed is None and read_documents(out) != documents_record(listing, digest=digest):
        # the same documents, other files skipped (a binary file added, say):
        # the stream stands, the list's counts are brought up to date
        publish_documents(out, listing, documents_record(listing, digest=digest))
    return rebuilt


def _cache_lock(out: str):
    """The stream's lock, held while it is checked and rebuilt, so that two
    processes (two runs on the default corpus) never interleave the
    publications of a pair: the second waits, then finds the stream fresh.
    Where the folder does not exist yet, nothing is locked: there is
    nothing to interleave with until it is made."""
    lock = Lock(out, "stream")
    if not os.path.isdir(os.path.dirname(lock.path)):
        return contextlib.nullcontext()
    try:
        return lock.acquire()
    except InUseError:
        print(f"note: stream {out} is being made by another process; waiting for it",
              file=sys.stderr, flush=True)
        return lock.acquire(wait=True)


def check_stream_output(out: str, listing: Listing) -> None:
    """A stream's path (and those of its tokenizer, digest and document list
    beside it) must be a regular file or absent, and none may be the
    source's file or a document of its folder (writing it would change the
    source it is made of)."""
    output_target(out, "stream")
    tokenizer = tokenizer_beside(out)
    if os.path.basename(out) == TOKENIZER_NAME or same_file(out, tokenizer):
        raise StreamError(f"stream {out}: is where its own {TOKENIZER_NAME} goes; "
                          f"name the stream otherwise")
    output_target(tokenizer, "tokenizer")
    output_target(digest_beside(out), "stream digest")
    output_target(documents_beside(out), "document list")
    outputs = (out, tokenizer, digest_beside(out), documents_beside(out))
    if listing.kind == FILE:
        for path in outputs:
            if same_file(path, listing.root):
                raise StreamError(f"stream {out}: writing it would replace the source "
                                  f"{listing.root}")
    elif listing.kind == FOLDER:
        root = os.path.realpath(listing.root)
        for path in outputs:
            rel = os.path.relpath(os.path.realpath(path), root)
            parts = rel.split(os.sep)
            if rel != os.curdir and parts[0] != os.pardir and not any(
                    part.startswith(".") for part in parts):
                raise StreamError(f"stream {out}: writing it would add {path} to the source "
                                  f"folder {listing.root}; write the stream outside it (or "
                                  f"under a hidden folder of it)")


def check_replaceable(out: str) -> None:
    """Refuse to replace a file at the stream's path that is not a token
    stream (header, then whole ids), or a tokenizer.json beside it that is
    no stream's: neither was written here, so neither is ours to replace."""
    try:
        size = os.stat(out).st_size
    except (FileNotFoundError, NotADirectoryError):
        size = None  # writing says why a missing folder cannot be made
    if size is not None and (size < HEADER_BYTES or (size - HEADER_BYTES) % TOKEN_BYTES):
        raise StreamError(f"stream {out}: exists and is not a token stream ({size} bytes); "
                          f"refusing to replace it")
    tokenizer = tokenizer_beside(out)
    if size is None and os.path.lexists(tokenizer) and not os.path.lexists(digest_beside(out)):
        raise StreamError(f"stream {out}: {tokenizer} exists beside it and belongs to no stream "
                          f"written here; refusing to replace it (move it, or write the stream "
                          f"to a folder of its own)")
