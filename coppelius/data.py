"""From a source text to a token stream (SPEC section 8), and the
`coppelius tokenize` subcommand.

The tokenizer is a byte-level BPE with exactly V ids, trained on the source
with Hugging Face `tokenizers` and saved as `tokenizer.json` beside the
stream; its SHA-256 is the data identity's `tokenizer` part.

The embedded default source is the running Python's standard library:
every `.py` file under `sysconfig`'s stdlib path except those under
`site-packages`, sorted by relative path (POSIX separators), each preceded by
a line `# file: <relative path>`, concatenated. Files are decoded as UTF-8
with errors="replace": the few test files written on purpose in another
encoding (or with invalid bytes) are kept, deterministically, with U+FFFD in
place of their bad bytes, so the file list is the same on every machine with
the same Python; a file the process may not read is left out. A file that
does not end with a newline gets one, so each `# file:` marker is a line of
its own.

Cache layout under a cache directory (by default runs/data under the current
directory, beside the runs the main job writes to runs/<preset>, so that
`coppelius tokenize` and `coppelius train` share one cache):

    corpus/stdlib-<python version>.txt       the materialised default source
    <source stem>-v<V>/<source stem>-v<V>.tokens   the stream
    <source stem>-v<V>/tokenizer.json        its tokenizer

A folder holds one stream, because its tokenizer is named `tokenizer.json`:
writing a stream into a folder that holds another is refused. A cached stream
is reused only when its header holds the source's current mtime (ns) and size,
a tokenizer of V ids lies beside it, and that tokenizer encodes the first and
last pieces of the source to the stream's first and last ids (so a stream is
never trusted beside another stream's tokenizer); otherwise it is rebuilt.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import sys
import sysconfig
import tempfile
import time

import numpy as np

from coppelius.reference.config import PRESETS, preset
from coppelius.reference.errors import ConfigError, StreamError
from coppelius.reference.fsutil import fsync_directory, publish
from coppelius.reference.stream import (HEADER_BYTES, TOKEN_BYTES, open_stream, read_stream_header,
                              stream_body)

TOKENIZER_NAME = "tokenizer.json"
STREAM_SUFFIX = ".tokens"
BYTE_SYMBOLS = 256  # a byte-level BPE starts from one symbol per byte value
PIECE_CHARS = 1 << 16  # the text is trained on and encoded in pieces of about 64 K characters
ENCODE_PIECES = 64  # pieces per encode_batch call: bounds the memory of the Encoding objects

# A piece boundary where the byte-level pre-tokenizer would split anyway, so
# that pieces encode exactly as the whole text does: right after a newline that
# follows a printable ASCII character, before a printable ASCII character. The
# GPT-2 pattern ('s|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)
# ends a word before "\n" there, makes "\n" a word of its own (the next
# character is not whitespace) and starts afresh after it. Printable ASCII
# rather than \S because Python's and Rust's ideas of whitespace differ
# outside ASCII.
_BOUNDARY = re.compile(r"(?<=[!-~]\n)(?=[!-~])")


def fs_error(what: str, path, e: OSError) -> StreamError:
    """A file-system failure as one line: `what` names the path and the
    action, then the system's reason, and the path it failed at when that is
    another one (a parent directory that is a file, say)."""
    failed = e.filename2 if e.filename2 is not None else e.filename  # a rename's target
    at = ""
    if failed is not None and os.path.abspath(failed) != os.path.abspath(path):
        at = f" at {os.fsdecode(failed)}"
    return StreamError(f"{what} ({e.strerror or e}{at})")


# ---------------------------------------------------------------------------
# The embedded default source

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


def default_corpus_text(root: str | None = None) -> str:
    """The default source's text (see the module docstring)."""
    root = root or stdlib_root()
    parts = []
    for rel in stdlib_files(root):
        try:
            with open(os.path.join(root, *rel.split("/")), "rb") as f:
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            continue  # unreadable on this machine (permissions): not part of the corpus
        if text and not text.endswith("\n"):
            text += "\n"
        parts.append(f"# file: {rel}\n")
        parts.append(text)
    return "".join(parts)


def materialise_default_corpus(cache_dir, root: str | None = None) -> str:
    """Write the default source as a text file under `cache_dir`/corpus and
    return its path. The file is only rewritten when its content changes, so
    its mtime (and with it the stream cache) stays valid from run to run."""
    data = default_corpus_text(root).encode("utf-8")
    path = os.path.join(os.fspath(cache_dir), "corpus", default_source_name() + ".txt")
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return path
    except (FileNotFoundError, NotADirectoryError):
        pass  # not there yet (writing says why it cannot make it)
    except OSError as e:
        raise fs_error(f"corpus {path}: cannot read", path, e) from None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        publish(path, lambda f: f.write(data))
    except OSError as e:
        raise fs_error(f"corpus {path}: cannot write", path, e) from None
    return path


# ---------------------------------------------------------------------------
# The tokenizer

def read_source(path) -> str:
    """A source file's text, UTF-8, newlines kept as they are."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise StreamError(f"source {path}: no such file") from None
    except OSError as e:
        raise StreamError(f"source {path}: cannot read ({e.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StreamError(f"source {path}: not UTF-8 at byte offset {e.start}") from None


def pieces(text: str, size: int | None = None):
    """Split `text` into pieces of at least `size` characters (the last may be
    shorter) at boundaries where the pre-tokenizer splits anyway: training and
    encoding piece by piece give what the whole text would."""
    size = size or PIECE_CHARS
    start = 0
    while start < len(text):
        m = _BOUNDARY.search(text, start + size) if start + size < len(text) else None
        end = m.start() if m else len(text)
        yield text[start:end]
        start = end


def check_vocab(vocab: int) -> None:
    if vocab < BYTE_SYMBOLS:
        raise ConfigError(f"vocab={vocab}: a byte-level BPE needs at least {BYTE_SYMBOLS} ids "
                          f"(one per byte value)")


def train_tokenizer(source, vocab: int, name: str | None = None):
    """A byte-level BPE with exactly `vocab` ids trained on `source` (a path,
    or an iterable of strings). A source too small to yield `vocab` ids is
    refused, naming it and the count (padding with unused ids would make
    tokens no text ever produces).

    The whole source is trained on: for the 31.6 MB default corpus that is
    about 4 s (V=2048) to 6 s (V=12288) on two idle cores, against about
    10 s to encode it, so no subset is needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab(vocab)
    if isinstance(source, (str, os.PathLike)):
        name = name or os.fspath(source)
        texts = pieces(read_source(source))
    else:
        name = name or "the given text"
        texts = (piece for text in source for piece in pieces(text))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    got = tokenizer.get_vocab_size()
    if got != vocab:
        raise StreamError(f"source {name}: yields {got} distinct tokens, fewer than the "
                          f"vocabulary V={vocab}; use a larger source or a smaller --vocab")
    return tokenizer


def encode(tokenizer, text: str, progress: bool = False) -> np.ndarray:
    """The ids of `text` (N,) uint32, encoded in batches of pieces."""
    from tqdm import tqdm

    batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets
    ids = []
    todo = list(pieces(text))
    with tqdm(total=len(text), unit="char", unit_scale=True, desc="encoding",
              disable=not progress, leave=False) as bar:
        for i in range(0, len(todo), ENCODE_PIECES):
            group = todo[i:i + ENCODE_PIECES]
            for encoding in batch(group, add_special_tokens=False):
                ids.append(np.array(encoding.ids, dtype=np.uint32))
            bar.update(sum(map(len, group)))
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.uint32)


def load_tokenizer(path):
    from tokenizers import Tokenizer

    path = os.fspath(path)
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise StreamError(f"tokenizer {path}: cannot load ({e})") from None


def tokenizer_sha(path) -> str | None:
    """Hex SHA-256 of a tokenizer.json's bytes, or None where there is none."""
    if path is None:
        return None
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise fs_error(f"tokenizer {os.fspath(path)}: cannot read", path, e) from None
    return h.hexdigest()


def tokenizer_beside(stream_path) -> str:
    return os.path.join(os.path.dirname(os.fspath(stream_path)), TOKENIZER_NAME)


# ---------------------------------------------------------------------------
# Source -> stream, with the cache

def default_cache_dir() -> str:
    """runs/data under the current directory: the one place `tokenize` and
    `train` keep cached corpora and streams unless told otherwise."""
    return os.path.join("runs", "data")


def source_stamp(path) -> tuple:
    """(mtime_ns, size) of a source: what a stream's header records."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise StreamError(f"source {path}: no such file") from None
    except OSError as e:
        raise fs_error(f"source {path}: cannot read", path, e) from None
    return st.st_mtime_ns, st.st_size


def head_and_tail(text: str) -> tuple:
    """The first piece of `text` and a last piece, each cut where the
    pre-tokenizer splits anyway (see pieces), so each encodes to the first /
    last ids of the whole text's encoding. The tail starts at the first
    boundary of the last PIECE_CHARS characters that hold one; it is empty
    only when the head is the whole text."""
    head = next(pieces(text), "")
    end = len(text)
    while end > len(head):
        start = max(end - PIECE_CHARS, len(head))
        m = _BOUNDARY.search(text, start, end)
        if m:
            return head, text[m.start():]
        end = start
    return head, ""


def encodes_to(tokenizer, text: str, ids: np.ndarray) -> bool:
    """Whether `tokenizer` turns the head and the tail of `text` into the
    first and last ids of `ids` (N,). A tokenizer trained on another source,
    or with another V, encodes them otherwise: this pairs a stream with the
    tokenizer that made it without storing anything beyond SPEC's files, at
    the cost of encoding about 2 * PIECE_CHARS characters."""
    for piece, at_end in zip(head_and_tail(text), (False, True)):
        want = np.array(tokenizer.encode(piece, add_special_tokens=False).ids, dtype=np.uint32)
        if want.size > ids.size:
            return False
        got = ids[ids.size - want.size:] if at_end else ids[:want.size]
        if not np.array_equal(got, want):
            return False
    return True


def is_fresh(stream_path, source_path, vocab: int) -> bool:
    """Whether the cached stream was made from the source as it is now, by
    the tokenizer of `vocab` ids that lies beside it."""
    try:
        if read_stream_header(stream_path) != source_stamp(source_path):
            return False
        tokenizer_path = tokenizer_beside(stream_path)
        if not os.path.isfile(tokenizer_path):
            return False
        tokenizer = load_tokenizer(tokenizer_path)
        if tokenizer.get_vocab_size() != vocab:
            return False
        stream = open_stream(stream_path, vocab)
        return encodes_to(tokenizer, read_source(source_path), stream.ids)
    except StreamError:
        return False


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


def publish_pair(stream_path, ids: np.ndarray, mtime_ns: int, size: int,
                 tokenizer_json: str) -> str:
    """Publish a stream of `ids` (N,) and its tokenizer.json -> the tokenizer
    path. Two files cannot be renamed at once, so the order is chosen for
    what any failure or crash leaves behind:

      1. the whole stream is written and synced under a staged name;
      2. the tokenizer is published (written, synced, renamed);
      3. the staged stream is renamed over the stream.

    A failure in 1 or 2 (ENOSPC, say) changes nothing published. A crash
    between 2 and 3 leaves the new tokenizer beside the old stream, and
    is_fresh turns that pair down, so the next run rebuilds it: the old
    header names an older source, or the new tokenizer does not encode the
    source to the old ids. (It is accepted only where it is a true pair: the
    same source and V train the same tokenizer, byte for byte.) At no point
    is the old stream left without a tokenizer."""
    stream_path = os.fspath(stream_path)
    tokenizer_path = tokenizer_beside(stream_path)
    directory = os.path.dirname(os.path.abspath(stream_path))
    staged = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, staged = tempfile.mkstemp(prefix="." + os.path.basename(stream_path) + ".",
                                      suffix=".staged", dir=directory)
        os.close(fd)
        publish(staged, stream_body(ids, mtime_ns, size, stream_path))  # 1
        payload = tokenizer_json.encode("utf-8")
        try:
            publish(tokenizer_path, lambda f: f.write(payload))  # 2
        except OSError as e:
            raise fs_error(f"tokenizer {tokenizer_path}: cannot write", tokenizer_path, e) from None
        os.replace(staged, stream_path)  # 3
        staged = None
        fsync_directory(directory)
    except OSError as e:
        raise fs_error(f"stream {stream_path}: cannot write", stream_path, e) from None
    finally:
        if staged is not None:
            try:
                os.unlink(staged)
            except OSError:
                pass  # a hidden leftover; the published files are what matter
    return tokenizer_path


def tokenize_source(source_path, stream_path, vocab: int, progress: bool = False) -> dict:
    """Train the tokenizer on the source, encode it, publish the stream and
    its tokenizer.json (publish_pair). Returns what was written."""
    started = time.perf_counter()
    source_path = os.fspath(source_path)
    mtime_ns, size = source_stamp(source_path)
    text = read_source(source_path)
    if progress:
        print(f"training a byte-level BPE of {vocab} ids on {source_path} "
              f"({size:,} bytes)", file=sys.stderr)
    tokenizer = train_tokenizer([text], vocab, name=source_path)
    ids = encode(tokenizer, text, progress=progress)  # (N,)
    tokenizer_path = publish_pair(stream_path, ids, mtime_ns, size, tokenizer.to_str())
    return {"stream": os.fspath(stream_path), "tokenizer": tokenizer_path, "ids": int(ids.size),
            "seconds": time.perf_counter() - started}


def prepare_stream(*, source=None, stream=None, vocab: int, out=None, cache_dir=None,
                   progress: bool = False) -> tuple:
    """The stream a run reads -> (stream path, tokenizer path or None).

    With `stream`, use it as is (with the tokenizer.json beside it, if any).
    Otherwise tokenize `source` (the embedded default when None) into `out`
    (default `<cache_dir>/<stem>-v<vocab>/<stem>-v<vocab>.tokens`, cache_dir
    None meaning default_cache_dir()), reusing a fresh cached stream and
    rebuilding a stale one."""
    if stream is not None:
        if source is not None:
            raise ConfigError("give a source or a stream, not both")
        stream = os.fspath(stream)
        if os.path.isdir(stream):
            raise StreamError(f"stream {stream}: is a directory, not a token stream")
        if not os.path.isfile(stream):
            raise StreamError(f"stream {stream}: no such token stream")
        tokenizer_path = tokenizer_beside(stream)
        return stream, tokenizer_path if os.path.isfile(tokenizer_path) else None
    stream, tokenizer_path, _ = stream_for_source(source, vocab, out, cache_dir, progress)
    return stream, tokenizer_path


def stream_for_source(source, vocab: int, out=None, cache_dir=None,
                      progress: bool = False) -> tuple:
    """prepare_stream's work for a source -> (stream, tokenizer, rebuilt?)."""
    check_vocab(vocab)
    cache_dir = os.fspath(default_cache_dir() if cache_dir is None else cache_dir)
    if source is not None:
        source = os.fspath(source)
        source_stamp(source)  # a missing source is refused before anything is written
    if out is None:
        name = default_source_name() if source is None else os.path.splitext(
            os.path.basename(source))[0]
        stem = f"{name}-v{vocab}"
        out = os.path.join(cache_dir, stem, stem + STREAM_SUFFIX)
    out = os.fspath(out)
    if os.path.isdir(out):
        raise StreamError(f"stream {out}: is a directory, not a token stream file")
    if source is None:
        source = materialise_default_corpus(cache_dir)
    rebuilt = not is_fresh(out, source, vocab)
    if rebuilt:
        check_folder_is_its_own(out)
        tokenize_source(source, out, vocab, progress=progress)
    return out, tokenizer_beside(out), rebuilt


# ---------------------------------------------------------------------------
# coppelius tokenize

def default_preset() -> str:
    """`coppelius` where a GPU with CuPy is available, else `tiny` (SPEC section 15)."""
    from coppelius.accelerated import best_backend

    return "coppelius" if best_backend() == "cupy" else "tiny"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "tokenize", help="turn a source text into a token stream",
        description="Train a byte-level BPE of V ids on SOURCE (default: the running Python's "
                    "standard library) and write the token stream and tokenizer.json beside it. "
                    "A stream that is up to date with its source is reused.")
    p.add_argument("source", nargs="?", metavar="SOURCE",
                   help="a UTF-8 text file (default: the embedded standard-library corpus)")
    p.add_argument("--out", metavar="STREAM",
                   help="the stream file (default: in the cache directory)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="the preset whose vocabulary and context to use "
                        "(default: coppelius with a GPU, else tiny)")
    p.add_argument("--vocab", type=int, metavar="N", help="vocabulary size V (default: the preset's)")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="where cached corpora and streams live (default: runs/data, the "
                        "cache `coppelius train` uses)")
    p.set_defaults(func=run_tokenize)


def run_tokenize(args) -> int:
    preset_name = args.preset or default_preset()
    config = preset(preset_name)
    vocab = config.vocab if args.vocab is None else args.vocab
    started = time.perf_counter()
    stream_path, tokenizer_path, rebuilt = stream_for_source(
        args.source, vocab, args.out, args.cache_dir, progress=sys.stderr.isatty())
    seconds = time.perf_counter() - started
    n = (os.path.getsize(stream_path) - HEADER_BYTES) // TOKEN_BYTES
    K = max(n - 1, 0) // config.context
    print(f"{'wrote' if rebuilt else 'up to date'} {stream_path}: {n:,} ids, "
          f"{K:,} contexts of T={config.context} ({preset_name} preset), vocabulary V={vocab}")
    print(f"{tokenizer_path}: sha256 {tokenizer_sha(tokenizer_path)}")
    print(f"{seconds:.1f} s")
    return 0
