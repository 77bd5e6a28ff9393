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

Cache layout under a cache directory (by default $XDG_CACHE_HOME/coppelius):

    corpus/stdlib-<python version>.txt       the materialised default source
    <source stem>-v<V>/<source stem>-v<V>.tokens   the stream
    <source stem>-v<V>/tokenizer.json        its tokenizer

One directory per stream, because the tokenizer is named `tokenizer.json`.
A cached stream is reused when its header holds the source's current mtime
(ns) and size and a tokenizer of V ids lies beside it; otherwise it is rebuilt.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import sys
import sysconfig
import time

import numpy as np

from reference.config import PRESETS, preset
from reference.errors import ConfigError, StreamError
from reference.fsutil import publish
from reference.stream import HEADER_BYTES, TOKEN_BYTES, read_stream_header, write_stream

TOKENIZER_NAME = "tokenizer.json"
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
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(path), exist_ok=True)
    publish(path, lambda f: f.write(data))
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
    return h.hexdigest()


def tokenizer_beside(stream_path) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(stream_path)), TOKENIZER_NAME)


# ---------------------------------------------------------------------------
# Source -> stream, with the cache

def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "coppelius")


def source_stamp(path) -> tuple:
    """(mtime_ns, size) of a source: what a stream's header records."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise StreamError(f"source {os.fspath(path)}: no such file") from None
    return st.st_mtime_ns, st.st_size


def is_fresh(stream_path, source_path, vocab: int) -> bool:
    """Whether the cached stream was made from the source as it is now, with a
    tokenizer of `vocab` ids beside it."""
    try:
        if read_stream_header(stream_path) != source_stamp(source_path):
            return False
    except StreamError:
        return False
    tokenizer_path = tokenizer_beside(stream_path)
    if not os.path.exists(tokenizer_path):
        return False
    try:
        return load_tokenizer(tokenizer_path).get_vocab_size() == vocab
    except StreamError:
        return False


def tokenize_source(source_path, stream_path, vocab: int, progress: bool = False) -> dict:
    """Train the tokenizer on the source, encode it, publish the stream and
    its tokenizer.json. Returns what was written."""
    started = time.perf_counter()
    source_path = os.fspath(source_path)
    mtime_ns, size = source_stamp(source_path)
    text = read_source(source_path)
    if progress:
        print(f"training a byte-level BPE of {vocab} ids on {source_path} "
              f"({size:,} bytes)", file=sys.stderr)
    tokenizer = train_tokenizer([text], vocab, name=source_path)
    ids = encode(tokenizer, text, progress=progress)
    tokenizer_path = tokenizer_beside(stream_path)
    os.makedirs(os.path.dirname(tokenizer_path), exist_ok=True)
    # The old tokenizer goes first: whatever instant the process dies at, a
    # stream never sits beside a tokenizer that did not make it (the cache
    # check then finds no tokenizer and rebuilds).
    try:
        os.unlink(tokenizer_path)
    except FileNotFoundError:
        pass
    write_stream(stream_path, ids, mtime_ns, size)
    payload = tokenizer.to_str().encode("utf-8")
    publish(tokenizer_path, lambda f: f.write(payload))
    return {"stream": os.fspath(stream_path), "tokenizer": tokenizer_path, "ids": int(ids.size),
            "seconds": time.perf_counter() - started}


def prepare_stream(*, source=None, stream=None, vocab: int, out=None, cache_dir=None,
                   progress: bool = False) -> tuple:
    """The stream a run reads -> (stream path, tokenizer path or None).

    With `stream`, use it as is (with the tokenizer.json beside it, if any).
    Otherwise tokenize `source` (the embedded default when None) into `out`
    (default `<cache_dir>/<stem>-v<vocab>/<stem>-v<vocab>.tokens`), reusing a
    fresh cached stream and rebuilding a stale one."""
    if stream is not None:
        if source is not None:
            raise ConfigError("give a source or a stream, not both")
        stream = os.fspath(stream)
        if not os.path.isfile(stream):
            raise StreamError(f"{stream}: no such token stream")
        tokenizer_path = tokenizer_beside(stream)
        return stream, tokenizer_path if os.path.exists(tokenizer_path) else None
    stream, tokenizer_path, _ = stream_for_source(source, vocab, out, cache_dir, progress)
    return stream, tokenizer_path


def stream_for_source(source, vocab: int, out=None, cache_dir=None,
                      progress: bool = False) -> tuple:
    """prepare_stream's work for a source -> (stream, tokenizer, rebuilt?)."""
    check_vocab(vocab)
    cache_dir = os.fspath(cache_dir or default_cache_dir())
    if source is None:
        source = materialise_default_corpus(cache_dir)
    source = os.fspath(source)
    source_stamp(source)  # a missing source is refused before anything is written
    if out is None:
        stem = f"{os.path.splitext(os.path.basename(source))[0]}-v{vocab}"
        out = os.path.join(cache_dir, stem, stem + ".tokens")
    out = os.fspath(out)
    rebuilt = not is_fresh(out, source, vocab)
    if rebuilt:
        tokenize_source(source, out, vocab, progress=progress)
    return out, tokenizer_beside(out), rebuilt


# ---------------------------------------------------------------------------
# coppelius tokenize

def default_preset() -> str:
    """`coppelius` where a GPU with CuPy is available, else `tiny` (SPEC section 15)."""
    from accelerated import best_backend

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
                   help="where cached corpora and streams live "
                        "(default: $XDG_CACHE_HOME/coppelius, else ~/.cache/coppelius)")
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
