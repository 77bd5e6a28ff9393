"""`coppelius tokenize`: a source made a token stream (coppelius/data.py
does the work, coppelius/tokenizer.py trains or loads the tokenizer), and
the source options `train` shares (SPEC 8, 22)."""

from __future__ import annotations

import os
import sys
import time

from coppelius.data import describe, documents_beside, read_documents, stream_for_source
from coppelius.plan import default_preset
from coppelius.reference.config import PRESETS, preset
from coppelius.reference.fsutil import path_argument
from coppelius.reference.stream import HEADER_BYTES, TOKEN_BYTES
from coppelius.tokenizer import tokenizer_sha


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "tokenize", help="turn a source text into a token stream",
        description="Train a byte-level BPE of V ids on SOURCE (default: the running Python's "
                    "standard library) and write the token stream and tokenizer.json beside it. "
                    "A folder's text files are documents, concatenated in a fixed shuffled "
                    "order (binary files skipped and counted). A stream that is up to date "
                    "with its source is reused.")
    p.add_argument("source", nargs="?", metavar="SOURCE", type=path_argument,
                   help="a UTF-8 text file, a .jsonl(.gz|.zst) or .parquet file of records, "
                        "or a folder of either (default: the embedded standard-library "
                        "corpus; SPEC §8, §22)")
    p.add_argument("--out", metavar="STREAM", type=path_argument,
                   help="the stream file (default: in the cache directory)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="the preset whose vocabulary and context to use "
                        "(default: coppelius with a GPU, else tiny)")
    p.add_argument("--vocab", type=int, metavar="N", help="vocabulary size V (default: the preset's)")
    p.add_argument("--cache-dir", metavar="DIR", type=path_argument,
                   help="where cached streams live (default: the user's cache, "
                        "$COPPELIUS_CACHE, else $XDG_CACHE_HOME/coppelius, else "
                        "~/.cache/coppelius; the cache `coppelius train` uses)")
    add_source_options(p)
    p.set_defaults(func=run_tokenize)


def add_source_options(p, tokenizer: bool = True) -> None:
    """--tokenizer, --eos and --text-field (SPEC 22), shared by `tokenize` and `train`."""
    if tokenizer:
        p.add_argument("--tokenizer", metavar="PATH", type=path_argument,
                       help="encode SOURCE with this tokenizer.json (or the one in this Hugging "
                            "Face directory) instead of training a BPE on it (SPEC §22)")
    p.add_argument("--eos", metavar="TOKEN",
                   help="follow each document with this token (default: a --tokenizer's own "
                        "eos_token or <|endoftext|>; none for the project's own BPE)")
    p.add_argument("--text-field", metavar="NAME",
                   help="the field of .jsonl / .parquet records that is a document "
                        "(default: text)")


def run_tokenize(args) -> int:
    preset_name = args.preset or default_preset()
    config = preset(preset_name)
    vocab = config.vocab if args.vocab is None else args.vocab
    started = time.perf_counter()
    stream_path, tokenizer_path, rebuilt, listing = stream_for_source(
        args.source, vocab, args.out, args.cache_dir, progress=sys.stderr.isatty(),
        tokenizer=args.tokenizer, eos=args.eos, text_field=args.text_field)
    seconds = time.perf_counter() - started
    n = (os.path.getsize(stream_path) - HEADER_BYTES) // TOKEN_BYTES
    K = max(n - 1, 0) // config.context
    print(f"{'wrote' if rebuilt else 'up to date'} {stream_path}: {n:,} ids, "
          f"{K:,} contexts of T={config.context} ({preset_name} preset), vocabulary V={vocab}")
    print(f"{describe(listing)}: {listing.summary()}; their order: "
          f"{documents_beside(stream_path)}")
    record = read_documents(stream_path) or {}
    if isinstance(record.get("count"), int):  # written document by document
        after = "no separator" if record.get("eos") is None else \
            f"each followed by {record['eos']!r}"
        print(f"{record['count']:,} documents, {after}")
    if n:
        print(f"{listing.size / n:.2f} source bytes per id")
    print(f"{tokenizer_path}: sha256 {tokenizer_sha(tokenizer_path)}")
    print(f"{seconds:.1f} s")
    return 0
