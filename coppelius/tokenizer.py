"""The tokenizer (SPEC sections 8 and 22): a byte-level BPE with exactly V
ids, trained on the source text with Hugging Face `tokenizers` and saved as
`tokenizer.json` beside the stream, or one given with --tokenizer (a
tokenizer.json or a Hugging Face directory holding one), checked to fit V;
its SHA-256 is the data identity's `tokenizer` part.

Text is trained on and encoded in pieces cut where the byte-level
pre-tokenizer splits anyway (pieces, stream_pieces), so that the pieces
encode exactly as the whole text does. Here too: the separator that follows
each document (--eos, or the one a given tokenizer names), and fs_error, a
file-system failure as one line, which coppelius.data uses as well.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np

from coppelius.corpus import EMBEDDED, Listing, file_listing
from coppelius.reference.errors import ConfigError, StreamError
from coppelius.reference.fsutil import open_regular

TOKENIZER_NAME = "tokenizer.json"
# Ids are uint32 in the stream (SPEC 8), and the tokenizers library counts
# its vocabulary in 32 bits too (it aborts the process at 2^32).
MAX_VOCAB = 2**32 - 1
BYTE_SYMBOLS = 256  # a byte-level BPE starts from one symbol per byte value
PIECE_CHARS = 1 << 16  # the text is trained on and encoded in pieces of about 64 K characters
ENCODE_PIECES = 64  # pieces per encode_batch call: bounds the memory of the Encoding objects
ENDOFTEXT = "<|endoftext|>"  # the separator a tokenizer defines when it names none (SPEC 22)
TOKENIZER_CONFIG = "tokenizer_config.json"

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


def read_source(path) -> str:
    """A source file's text, UTF-8, newlines kept as they are (a FIFO or a
    device is refused, never opened for reading)."""
    return file_listing(path).text()


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


def stream_pieces(chunks, size: int | None = None):
    """pieces() of the text the iterable `chunks` (strings) makes when
    joined, without joining it: the same pieces, holding one piece and one
    chunk at a time. A boundary needs the character after it, so one at the
    end of a chunk is found with the next chunk."""
    size = size or PIECE_CHARS
    held, length = [], 0  # the piece so far, and its length
    before = ""  # the last (at most two) characters before `chunk`: the boundary looks back at them
    for chunk in chunks:
        while chunk:
            window = before + chunk
            # the piece is at least `size` long; positions before this chunk were looked at
            m = _BOUNDARY.search(window, len(before) + max(size - length, 0))
            if m is None:
                held.append(chunk)
                length += len(chunk)
                before = window[-2:]
                break
            cut = m.start() - len(before)  # in chunk
            yield "".join(held) + chunk[:cut]
            held, length = [], 0
            before, chunk = window[max(m.start() - 2, 0):m.start()], chunk[cut:]
    if length:
        yield "".join(held)


# where a smaller vocabulary is chosen: tokenize's option, a model's field
SMALLER_VOCAB = "tokenize --vocab N, or a model file's vocab = N for train --model"


def check_vocab(vocab: int, source_bytes: int | None = None) -> None:
    """A vocabulary a byte-level BPE can have: at least one id per byte
    value, ids that fit uint32, and (given the source's size) no more than
    one merge per byte of the source can make: each merge joins a pair that
    occurs in it."""
    if vocab < BYTE_SYMBOLS:
        raise ConfigError(f"vocab={vocab}: a byte-level BPE needs at least {BYTE_SYMBOLS} ids "
                          f"(one per byte value)")
    if vocab > MAX_VOCAB:
        raise ConfigError(f"vocab={vocab}: at most {MAX_VOCAB} (token ids are 32-bit)")
    if source_bytes is not None and vocab > BYTE_SYMBOLS + source_bytes:
        raise ConfigError(f"vocab={vocab}: a source of {source_bytes} bytes yields at most "
                          f"{BYTE_SYMBOLS + source_bytes} ids; use a larger source or a "
                          f"smaller vocabulary ({SMALLER_VOCAB})")


def train_tokenizer(source, vocab: int, name: str | None = None, eos: str | None = None):
    """A byte-level BPE with exactly `vocab` ids trained on `source` (a path,
    or an iterable of strings). A source too small to yield `vocab` ids is
    refused, naming it and the count (padding with unused ids would make
    tokens no text ever produces). `eos` (--eos) is made a special token of
    its own, one of the `vocab` ids. The source is consumed as an iterator,
    a piece at a time: training holds the BPE's counts, not the text.

    The whole source is trained on: for the 31.6 MB default corpus that is
    about 4 s (V=2048) to 6 s (V=12288) on two idle cores, against about
    10 s to encode it, so no subset is needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab(vocab)
    if isinstance(source, (str, os.PathLike)):
        name = name or os.fspath(source)
        texts = stream_pieces(file_listing(source).iter_chunks())
    else:
        name = name or "the given text"
        texts = (piece for text in source for piece in pieces(text))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[eos] if eos else [],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    got = tokenizer.get_vocab_size()
    if got != vocab:
        raise StreamError(f"source {name}: yields {got} distinct tokens, fewer than the "
                          f"vocabulary V={vocab}; use a larger source or a smaller vocabulary "
                          f"({SMALLER_VOCAB})")
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
        with open_regular(path) as f:  # read here: the library would open a FIFO and block
            text = f.read().decode("utf-8")
    except OSError as e:
        raise fs_error(f"tokenizer {path}: cannot read", path, e) from None
    except UnicodeDecodeError as e:
        raise StreamError(f"tokenizer {path}: not UTF-8 at byte offset {e.start}") from None
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        detail = (str(e).splitlines() or [type(e).__name__])[0]
        raise StreamError(f"tokenizer {path}: cannot load ({detail})") from None
    shared = shared_id(tokenizer)
    if shared is not None:
        raise StreamError(f"tokenizer {path}: {shared}")
    return tokenizer


def shared_id(tokenizer) -> str | None:
    """Why a tokenizer cannot be decoded faithfully, or None: two tokens of
    its vocabulary (added tokens included) under one id, so that the id
    could stand for either text. Ids it never produces (holes below its
    largest, as a padded V has above it) are fine."""
    owner = {}
    for token, token_id in sorted(tokenizer.get_vocab(with_added_tokens=True).items()):
        if token_id in owner:
            return (f"the tokens {owner[token_id]!r} and {token!r} share the id {token_id}; "
                    f"each id must stand for one token")
        owner[token_id] = token
    return None


def tokenizer_ids(tokenizer) -> int:
    """How many ids a tokenizer produces: one more than its largest
    (added tokens included). The project's own BPE has exactly V."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def check_tokenizer(path, vocab: int):
    """The tokenizer at `path`, refused unless it loads and every id it
    produces is below the model's V (SPEC 22: V may exceed the tokenizer's
    vocabulary, as an imported model's padded one does)."""
    tokenizer = load_tokenizer(path)
    ids = tokenizer_ids(tokenizer)
    if ids > vocab:
        raise StreamError(f"tokenizer {os.fspath(path)}: has {ids} ids, more than the model's "
                          f"V={vocab}")
    return tokenizer


def tokenizer_file(path) -> str:
    """--tokenizer PATH (SPEC 22): a tokenizer.json, or a Hugging Face
    directory holding one."""
    path = os.fspath(path)
    if os.path.isdir(path):
        inside = os.path.join(path, TOKENIZER_NAME)
        if not os.path.lexists(inside):
            raise StreamError(f"--tokenizer {path}: a directory without {TOKENIZER_NAME}")
        return inside
    if not os.path.lexists(path):
        raise StreamError(f"--tokenizer {path}: no such file")
    return path


def given_tokenizer(path, vocab: int) -> tuple:
    """(tokenizer, its file's text) of --tokenizer PATH, checked to fit V."""
    path = tokenizer_file(path)
    tokenizer = check_tokenizer(path, vocab)
    with open_regular(path) as f:  # load_tokenizer read it already: it is UTF-8
        return tokenizer, f.read().decode("utf-8")


def tokenizer_sha(path) -> str | None:
    """Hex SHA-256 of a tokenizer.json's bytes, or None where there is none."""
    if path is None:
        return None
    h = hashlib.sha256()
    try:
        with open_regular(path) as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise fs_error(f"tokenizer {os.fspath(path)}: cannot read", path, e) from None
    return h.hexdigest()


def tokenizer_beside(stream_path) -> str:
    return os.path.join(os.path.dirname(os.fspath(stream_path)), TOKENIZER_NAME)


def configured_eos(path) -> str | None:
    """The end-of-text token a --tokenizer PATH names (SPEC 22): for a
    Hugging Face directory, its tokenizer_config.json's `eos_token` (a
    string, or an added token's {"content": ...}); None where it names none."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return None
    config = os.path.join(path, TOKENIZER_CONFIG)
    try:
        with open_regular(config) as f:
            record = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise StreamError(f"--tokenizer {path}: cannot read {TOKENIZER_CONFIG} ({e})") from None
    eos = record.get("eos_token") if isinstance(record, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def separator(tokenizer, eos: str | None, given_path=None, listing: Listing | None = None):
    """(token, id) that follows each document in the stream, or None.

    `eos` (--eos TOKEN) must be a token of the tokenizer. Without it, a
    given tokenizer (--tokenizer `given_path`) brings its own: the one its
    directory's configuration names, else `<|endoftext|>` where its
    vocabulary holds it. The project's own BPE and the embedded corpus get
    none unless --eos is given: their streams stay as they were."""
    if eos is not None:
        token_id = tokenizer.token_to_id(eos)
        if token_id is None:
            raise ConfigError(f"--eos {eos!r}: not a token of the tokenizer"
                              f"{' ' + os.fspath(given_path) if given_path else ''}")
        return eos, token_id
    if given_path is None or (listing is not None and listing.kind == EMBEDDED):
        return None
    named = configured_eos(given_path)
    for token in (named, ENDOFTEXT):
        if token is not None and tokenizer.token_to_id(token) is not None:
            return token, tokenizer.token_to_id(token)
    return None
