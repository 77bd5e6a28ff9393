"""`coppelius sample`: text from a checkpoint.

The checkpoint's model identity gives the configuration, its data identity
names the tokenizer by SHA-256 (`tokenizer=<sha256>`). Generation runs a
forward on a sliding window of at most T tokens: each new token costs one
forward of the window. The forward is the backend's (`--backend`, default
the best available: CuPy with a GPU) on its program built on the
checkpoint's parameters (no update is taken; CuPy's last_logits: the window
padded to a few fixed lengths, only the last row read back), or the
reference's in fp32;
the sampling rules (pick) are the same on every backend.
"""

from __future__ import annotations

import glob
import os
import sys
import time

import numpy as np

from coppelius.reference.config import Config, config_from_identity
from coppelius.reference.errors import CheckpointError, ConfigError, NonFiniteError, StreamError
from coppelius.reference.fsutil import path_argument

# "def" rather than "def ": the byte-level BPE makes " name" one token, so a
# prompt ending in a space leaves a lone-space token the model rarely saw
# before a word (its continuation reads "def  return").
DEFAULT_PROMPT = "def"


PROMPT_TOKENS = 8  # about a line of code: enough to set the scene, short enough to read
PROMPT_LINE_TOKENS = 32  # a first line up to this long is kept whole


def corpus_prompt(stream, config: Config, tokenizer, context_index: int) -> str:
    """A prompt taken from the corpus: the first characters of context
    `context_index` of `stream` (its T input ids), in whole lines where it
    can. A context starts wherever T ids fall, mostly inside a line, so the
    prompt starts after its first line break (and any blank lines there).
    It is the first line, and the lines after it while all of them hold at
    most PROMPT_TOKENS tokens; a first line of more than PROMPT_LINE_TOKENS
    is cut to its first PROMPT_TOKENS. Trailing space and the line break
    are left out: the byte-level BPE joins them with what follows, so a
    prompt ending in one leaves a token the model rarely saw there (see
    DEFAULT_PROMPT). DEFAULT_PROMPT where the context holds no text.

    `tokenizer`: a tokenizers.Tokenizer, or the path of a tokenizer.json."""
    from coppelius.tokenizer import load_tokenizer

    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False).ids

    T = config.context
    ids = stream.batch(context_index, 1, T)[0, :T]  # (T,) the context's inputs
    lines = tokenizer.decode([int(i) for i in ids], skip_special_tokens=False).split("\n")
    if "".join(lines[1:]).strip():
        lines = lines[1:]  # the first line is, as a rule, the end of one cut off
    while len(lines) > 1 and not lines[0].strip():
        lines = lines[1:]
    prompt = lines[0]
    if len(encode(prompt)) > PROMPT_LINE_TOKENS:
        prompt = tokenizer.decode(encode(prompt)[:PROMPT_TOKENS], skip_special_tokens=False)
    else:
        for line in lines[1:-1]:  # the context's last line may be cut off: never taken
            if len(encode(prompt + "\n" + line)) > PROMPT_TOKENS:
                break
            prompt += "\n" + line
    # U+FFFD: the end of a character whose bytes a token boundary cut
    prompt = prompt.rstrip(" \t\r\n\ufffd")
    return prompt if prompt.strip() else DEFAULT_PROMPT


def load_parameters(path) -> tuple:
    """(config, P (N,) float32, header) of a checkpoint file, P bound by name
    through the binding layer (the moments are not read)."""
    from coppelius.reference.binding import bind_vectors, flatten
    from coppelius.reference.params import registry
    from coppelius.reference.sources import CheckpointFileSource

    with CheckpointFileSource(path) as source:  # validates layout and SHA-256
        header = source.header
        config = config_from_identity(header["model"], f"checkpoint {source.path}")
        values = bind_vectors(source, config, moments=False)
        P = flatten(registry(config), values)
    check_finite(config, P, f"checkpoint {os.fspath(path)}")
    return config, P, header


def check_finite(config: Config, P: np.ndarray, what: str) -> None:
    """Refuse parameters P (N,) with a NaN or an infinity, naming the first
    tensor and element: sampling from them would draw from NaN probabilities."""
    from coppelius.reference.params import registry

    if np.isfinite(P).all():
        return
    for spec in registry(config).specs:
        bad = np.flatnonzero(~np.isfinite(P[spec.slice]))
        if bad.size:
            index = ", ".join(str(int(i)) for i in np.unravel_index(bad[0], spec.shape))
            raise CheckpointError(f"{what}: parameters are not finite "
                                  f"(first: {spec.name}[{index}])")


def named_tokenizer(header: dict) -> str | None:
    """The tokenizer SHA-256 the data identity names, or None (`tokenizer=none`)."""
    for part in header["data"].split("|"):
        if part.startswith("tokenizer="):
            sha = part[len("tokenizer="):]
            return None if sha == "none" else sha
    return None


def tokenizer_candidates(checkpoint_path) -> list:
    """Where a checkpoint's tokenizer may lie, in order: beside the
    checkpoint (a run copies its stream's tokenizer there), the stream cache
    `data` beside its run directory, the default stream cache."""
    from coppelius.data import default_cache_dir
    from coppelius.tokenizer import TOKENIZER_NAME

    run_dir = os.path.dirname(os.path.abspath(checkpoint_path))
    places = [os.path.join(run_dir, TOKENIZER_NAME)]
    for cache in (os.path.join(os.path.dirname(run_dir), "data"), default_cache_dir()):
        places += sorted(glob.glob(os.path.join(glob.escape(cache), "*", TOKENIZER_NAME)))
    unique = []
    for place in places:  # the two caches are one when the run is runs/<name>
        if os.path.abspath(place) not in map(os.path.abspath, unique):
            unique.append(place)
    return unique


def find_tokenizer(checkpoint_path, header: dict, override=None) -> str:
    """The tokenizer.json whose SHA-256 the checkpoint names; `override`
    (--tokenizer) is used as given."""
    from coppelius.tokenizer import tokenizer_sha

    if override is not None:
        override = os.fspath(override)
        if os.path.isdir(override):
            raise StreamError(f"tokenizer {override}: is a directory, not a tokenizer.json")
        if not os.path.exists(override):
            raise StreamError(f"tokenizer {override}: no such file")
        return override
    sha = named_tokenizer(header)
    if sha is None:
        raise StreamError(f"checkpoint {checkpoint_path}: trained on a stream without a "
                          f"tokenizer (tokenizer=none); give one with --tokenizer PATH")
    for place in tokenizer_candidates(checkpoint_path):
        try:
            if tokenizer_sha(place) == sha:
                return place
        except StreamError:
            continue  # unreadable: not one this lookup can use
    raise StreamError(f"checkpoint {checkpoint_path}: no tokenizer.json with SHA-256 {sha} "
                      f"beside it, in its run directory or in the stream cache; "
                      f"give it with --tokenizer PATH")


def pick(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    """The next id from one row of logits (V,): the argmax at temperature 0,
    else a draw from softmax(logits / temperature) over the top_k largest
    (all when top_k is 0)."""
    if not np.isfinite(logits).all():
        raise NonFiniteError(f"the model's logits are not finite "
                             f"(first at id {int(np.flatnonzero(~np.isfinite(logits))[0])})")
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64)  # (V,)
    keep = np.argsort(-z, kind="stable")  # ties keep the lower id first
    if top_k:
        keep = keep[:top_k]
    # The max is subtracted before the division: (z - max) / temperature is
    # <= 0, so a tiny temperature gives -inf (weight 0), never inf - inf =
    # NaN, and the largest logits keep weight 1: the limit is greedy.
    with np.errstate(over="ignore"):  # -inf is the intended result, not an accident
        p = np.exp((z[keep] - z[keep[0]]) / temperature)  # (k,) in [0, 1], p[0] = 1
    return int(keep[rng.choice(keep.size, p=p / p.sum())])


def generate(config: Config, P: np.ndarray, ids, tokens: int, temperature: float = 0.0,
             top_k: int = 0, rng: np.random.Generator | None = None, logits_of=None,
             on_token=None) -> list:
    """`ids` followed by `tokens` new ids, each predicted from the last T
    (at most) ids: by default with the reference forward in fp32;
    `logits_of(window (1,n)) -> (1,n',V)` is another forward of the same
    parameters whose last row is the logits at the window's last position
    (a backend's program, which the run loop uses on a GPU).
    `on_token(ids)`: called with the ids so far after each new one."""
    from coppelius.reference import forward

    if logits_of is None:
        logits_of = lambda window: forward(config, P, window, "fp32")  # noqa: E731
    if len(ids) == 0:
        raise ConfigError("prompt is empty: the model has no start token, give some text")
    rng = rng or np.random.default_rng(0)
    out = [int(i) for i in ids]
    for _ in range(tokens):
        window = np.array(out[-config.context:], dtype=np.int64)[None, :]  # (1,n), n <= T
        logits = np.asarray(logits_of(window))[0, -1]  # (V,) at the last position
        out.append(pick(logits, temperature, top_k, rng))
        if on_token is not None:
            on_token(out)
    return out


class Continuation:
    """The text of the ids after a prompt, handed on piece by piece as it is
    made (`emit(text)`): each time the whole is decoded again and what is new
    is passed on, held back while it ends inside a character (a byte-level
    token can be part of one: the decoder's replacement character), so the
    pieces add up to the decoded continuation."""

    def __init__(self, tok, prompt_ids, emit):
        self.tok, self.emit = tok, emit
        self.prompt = tok.decode(list(prompt_ids), skip_special_tokens=False)
        self.sent = ""

    def text(self, ids) -> str:
        whole = self.tok.decode(list(ids), skip_special_tokens=False)
        return whole[len(self.prompt):] if whole.startswith(self.prompt) else whole

    def __call__(self, ids) -> None:
        text = self.text(ids)
        if text.startswith(self.sent) and not text.endswith("\ufffd"):
            self.emit(text[len(self.sent):])
            self.sent = text

    def finish(self, ids) -> None:
        text = self.text(ids)
        if text.startswith(self.sent) and len(text) > len(self.sent):
            self.emit(text[len(self.sent):])
            self.sent = text


def check_prompt(prompt: str) -> None:
    """A prompt must be text: an argument that is not valid UTF-8 reaches
    Python with its bad bytes as lone surrogates, which no tokenizer takes."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = prompt[e.start]
        what = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else repr(bad)
        raise ConfigError(f"--prompt: not valid UTF-8 ({what} at character {e.start})") from None


def check_options(tokens: int, temperature: float, top_k: int, seed: int = 0) -> None:
    if tokens < 0:
        raise ConfigError(f"--tokens={tokens}: must be >= 0")
    if not temperature >= 0 or temperature == float("inf"):
        raise ConfigError(f"--temperature={temperature}: must be a finite number >= 0")
    if top_k < 0:
        raise ConfigError(f"--top-k={top_k}: must be >= 0 (0: no limit)")
    if seed < 0:
        raise ConfigError(f"--seed={seed}: must be >= 0")


def backend_precision(backend: str, precision: str | None = None) -> str:
    """The precision `backend` samples in: `precision` (--precision) where
    given, else the backend's default; the reference's is fp32 only."""
    from coppelius import accelerated
    from coppelius.reference.config import check_precision

    if backend == "reference":
        if precision not in (None, "fp32"):
            raise ConfigError(f"--precision {precision}: the reference samples in fp32")
        return "fp32"
    return check_precision(precision or accelerated.capabilities(backend).default_precision)


def backend_logits(backend: str, config: Config, P: np.ndarray, precision: str | None = None):
    """`logits_of` for generate on `backend` (None: the reference's fp32
    forward): the backend's program built on the parameters P (N,) at batch
    1, in `precision` (default the backend's, backend_precision); no update
    is taken."""
    from coppelius import accelerated
    from coppelius.reference.config import Hyper, check_implemented
    from coppelius.reference.state import State

    precision = backend_precision(backend, precision)
    if backend == "reference":
        return None
    module = accelerated.backend_module(backend)  # a clear error when it is not available here
    check_implemented(config, getattr(module, "IMPLEMENTED", ()), backend)
    program = module.capture(config, Hyper(), precision, 1, State.fresh(P))
    last = getattr(program, "last_logits", None)
    if last is None:
        return program.logits
    return lambda window: last(window)[None, None, :]  # generate reads [0, -1]


def speed_line(tokens: int, seconds: float, backend: str, precision: str) -> str:
    """`80 tokens in 1.23 s: 65.0 tokens/s (cupy, bf16)`: the generation's
    rate, each token one forward of the window (generate)."""
    rate = tokens / seconds if seconds > 0 else float("inf")
    return f"{tokens} tokens in {seconds:.2f} s: {rate:.1f} tokens/s ({backend}, {precision})"


def generate_text(checkpoint_path, prompt: str = DEFAULT_PROMPT, tokens: int = 200,
                  temperature: float = 0.8, top_k: int = 40, seed: int = 0,
                  tokenizer=None, logits_of=None, backend: str = "reference",
                  precision: str | None = None, on_text=None, report=None) -> str:
    """The prompt and its continuation, decoded (`logits_of`: see generate;
    else `backend`'s forward, backend_logits). `on_text(piece)`: the
    continuation handed on as it is made (Continuation). `report(line)`:
    how long the backend's program took to build (when one was built
    here), then the generation's rate (speed_line; `backend` and
    `precision` name the forward in it, also when `logits_of` is given)."""
    from coppelius.tokenizer import load_tokenizer, tokenizer_file, tokenizer_ids

    check_options(tokens, temperature, top_k, seed)
    check_prompt(prompt)
    config, P, header = load_parameters(checkpoint_path)
    if tokenizer is not None:
        tokenizer = tokenizer_file(tokenizer)  # a tokenizer.json, or a directory holding one
    tokenizer_path = find_tokenizer(checkpoint_path, header, tokenizer)
    tok = load_tokenizer(tokenizer_path)
    if tokenizer_ids(tok) > config.vocab:  # SPEC 22: V may exceed the tokenizer's ids
        raise StreamError(f"tokenizer {tokenizer_path}: has {tokenizer_ids(tok)} ids, more than "
                          f"the checkpoint's model has (V={config.vocab})")
    ids = tok.encode(prompt, add_special_tokens=False).ids
    report = report or (lambda line: None)
    if logits_of is None:
        t0 = time.perf_counter()
        logits_of = backend_logits(backend, config, P, precision)
        if logits_of is not None:  # the reference builds no program
            report(f"program ready in {time.perf_counter() - t0:.1f} s")
    stream = Continuation(tok, ids, on_text) if on_text is not None else None
    t0 = time.perf_counter()
    out = generate(config, P, ids, tokens, temperature, top_k, np.random.default_rng(seed),
                   logits_of, stream)
    seconds = time.perf_counter() - t0  # the tokens and their decoding as they were handed on
    if stream is not None:
        stream.finish(out)
    report(speed_line(len(out) - len(ids), seconds, backend,
                      backend_precision(backend, precision)))
    return tok.decode(out, skip_special_tokens=False)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sample", help="generate text from a checkpoint",
        description="Continue a prompt with a checkpoint's model (the backend's forward on a "
                    "sliding window of the model's context; the same sampling rules on "
                    "every backend).")
    p.add_argument("checkpoint", metavar="CHECKPOINT", type=path_argument)
    from coppelius import accelerated

    p.add_argument("--backend", choices=sorted(accelerated.BACKENDS),
                   help="backend of the forward (default: the best available; the reference "
                        "runs in fp32)")
    p.add_argument("--precision", choices=["fp32", "bf16"],
                   help="the backend's precision policy (default: its own, bf16 on cupy)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, metavar="TEXT",
                   help=f"text to continue (default {DEFAULT_PROMPT!r})")
    p.add_argument("--tokens", type=int, default=200, metavar="N",
                   help="tokens to generate (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="X",
                   help="softmax temperature; 0 picks the most likely token (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, metavar="K",
                   help="draw from the K most likely tokens; 0 for all (default 40)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default 0)")
    p.add_argument("--tokenizer", metavar="PATH", type=path_argument,
                   help="tokenizer.json to use, or a Hugging Face directory holding one "
                        "(default: the one whose SHA-256 the checkpoint names)")
    p.set_defaults(func=run_sample)


def run_sample(args) -> int:
    """The prompt, then each piece of the continuation as it is made, on
    stdout; the program's build time and the generation's rate on stderr,
    so stdout holds the text alone."""
    started, later = [], []

    def emit(piece):
        if not started:  # the prompt, once the first piece is made
            started.append(True)
            sys.stdout.write(args.prompt)
        sys.stdout.write(piece)
        sys.stdout.flush()

    def report(line):
        if started:  # after the text: held for below its closing line break
            later.append(line)
        else:
            print(line, file=sys.stderr)

    text = generate_text(args.checkpoint, prompt=args.prompt, tokens=args.tokens,
                         temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                         tokenizer=args.tokenizer,
                         backend=args.backend or _best_backend(), precision=args.precision,
                         on_text=emit, report=report)
    if not started:  # nothing was generated (or nothing new): the text as decoded
        sys.stdout.write(text)
    print()
    sys.stdout.flush()
    for line in later:
        print(line, file=sys.stderr)
    return 0


def _best_backend() -> str:
    from coppelius import accelerated

    return accelerated.best_backend()
