"""`coppelius train`'s options (SPEC 9, 15): the parser of the command
whose run loop is coppelius/train.py and whose plan is coppelius/plan.py."""

from __future__ import annotations

import argparse

from coppelius import accelerated
from coppelius.plan import EVAL_CONTEXTS, LEARNER_OPTIONS
from coppelius.reference import fsutil
from coppelius.reference.config import PRESETS, SCHEDULES, SEED, Hyper, rational_text
from coppelius.reference.contract import RECOMPUTE_MODES

RECOMPUTE_CHOICES = ("none",) + RECOMPUTE_MODES  # --recompute MODE


def register(sub) -> None:
    p = sub.add_parser("train", help="train (or resume) a model and publish checkpoints",
                       description="Train a model on a token stream; resume from --checkpoint "
                                   "when it holds a checkpoint. The run directory's run.json "
                                   "remembers the options: `coppelius train --run-dir D` alone "
                                   "continues run D (SPEC §9).")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="model preset (default: coppelius with a GPU, else tiny)")
    p.add_argument("--model", metavar="FILE.toml",
                   help="model configuration file (SPEC §17); with --preset it overrides "
                        "the preset's fields")
    p.add_argument("--backend", choices=sorted(accelerated.BACKENDS),
                   help="backend (default: the best available)")
    p.add_argument("--precision", choices=["fp32", "bf16"],
                   help="precision policy (default: bf16 on cupy, else fp32)")
    data = p.add_mutually_exclusive_group()
    path = fsutil.path_argument  # an empty path is refused, not taken for "not given"
    data.add_argument("--source", metavar="PATH", type=path,
                      help="a text file, a .jsonl(.gz|.zst) or .parquet file of records, or a "
                           "folder of either, to tokenize and train on")
    data.add_argument("--stream", metavar="STREAM", type=path,
                      help="a token stream file, an llm.c or raw uint16 .bin shard, or a folder "
                           "or glob of shards, to train on (SPEC §22)")
    p.add_argument("--tokenizer", metavar="PATH", type=path,
                   help="encode --source with this tokenizer.json (or the one in this Hugging "
                        "Face directory) instead of training a BPE on it; its ids must be below "
                        "the model's V (SPEC §22)")
    from coppelius.tokenize import add_source_options

    add_source_options(p, tokenizer=False)
    p.add_argument("--checkpoint", metavar="PATH", type=path,
                   help="checkpoint to resume from and publish to (default: RUN_DIR/checkpoint.bin); "
                        "locked while the run uses it. With neither --preset nor --model, the "
                        "model is the checkpoint's (an imported one is fine-tuned as it is)")
    p.add_argument("--results", metavar="PATH", type=path,
                   help="result file to write; must not exist (default: RUN_DIR/results-<step>.bin)")
    p.add_argument("--run-dir", metavar="DIR", type=path,
                   help="output directory (default: runs/<preset>, or runs/<model file stem>, "
                        "or runs/<checkpoint file stem> when the model is --checkpoint's)")
    how_far = p.add_mutually_exclusive_group()
    how_far.add_argument("--steps", type=int, metavar="S", help="take S more steps")
    how_far.add_argument("--until", type=int, metavar="N",
                         help="train until the checkpoint's step is N (default: the run's final "
                              "step, at first the preset's step count)")
    p.add_argument("--interval", type=int, metavar="N",
                   help="publish a checkpoint every N steps (default: the preset's)")
    p.add_argument("--batch", type=int, metavar="B", help="contexts per step (default 1)")
    p.add_argument("--accumulate", type=int, metavar="K",
                   help="process each step's B contexts as K micro-batches of B/K, one update "
                        "(default 1; K must divide B; SPEC §19)")
    p.add_argument("--gpus", type=int, metavar="N",
                   help="data parallelism on N GPUs of this host: N processes, B/N contexts "
                        "each (default 1; N*K must divide B; cupy backend; SPEC §19). Under "
                        "torchrun, mpirun or srun the launcher's ranks are used instead")
    p.add_argument("--recompute", nargs="?", const="gate-up", choices=RECOMPUTE_CHOICES,
                   metavar="MODE",
                   help="compute again in the backward instead of keeping: gate-up (the "
                        "default MODE) each layer's gate and up products, block each "
                        "layer's whole forward from its input; the same bits, less device "
                        "memory, more time (default none; --no-recompute, or none, turns a "
                        "remembered one off)")
    p.add_argument("--no-recompute", dest="recompute", action="store_const", const="none",
                   help=argparse.SUPPRESS)
    p.add_argument("--shard-optimizer", action=argparse.BooleanOptionalAction,
                   help="with --gpus N > 1: each rank keeps the moments M and V of its 1/N of "
                        "the parameters alone (P, M and V about 4 + 8/N bytes a parameter "
                        "instead of 12, plus the gradient); the gradient reduce-scattered and "
                        "the parameters all-gathered in the step, the checkpoint the same "
                        "file; on one GPU or rank nothing changes (default off; "
                        "--no-shard-optimizer turns a remembered one off; SPEC §23)")
    hyper = Hyper()
    for name in LEARNER_OPTIONS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, metavar="X",
                       help=f"AdamW {name}, an exact rational or decimal "
                            f"(default {rational_text(getattr(hyper, name))})")
    p.add_argument("--schedule", choices=SCHEDULES,
                   help="learning-rate schedule (default constant; SPEC §7)")
    p.add_argument("--warmup", type=int, metavar="W",
                   help="cosine, wsd: warm-up updates (default 0)")
    p.add_argument("--total", type=int, metavar="N",
                   help="cosine, wsd: the update at which the rate reaches the floor "
                        "(default: the run's final step)")
    p.add_argument("--decay", type=int, metavar="D",
                   help="wsd: the updates of the linear decay that ends at --total, after the "
                        "stable phase (default: a fifth of total - warmup, at least 1)")
    p.add_argument("--floor", metavar="F", help="cosine, wsd: the final rate as a fraction of "
                                                "--lr (default 0)")
    p.add_argument("--clip", metavar="C", help="clip the gradient norm to C (default: off)")
    p.add_argument("--eval-contexts", type=int, metavar="K",
                   help=f"hold out the stream's last K contexts for evaluation (default "
                        f"{EVAL_CONTEXTS}, or a tenth of the stream if fewer; none below 10; "
                        f"SPEC §18)")
    p.add_argument("--eval-every", type=int, metavar="E",
                   help="evaluate the held-out contexts every E steps and after the last "
                        "(default: the checkpoint interval; 0: never)")
    held = p.add_mutually_exclusive_group()
    held.add_argument("--eval-source", metavar="PATH", type=path,
                      help="a validation set to tokenize with the run's tokenizer and evaluate "
                           "(its first K contexts; none of the stream is then held out; SPEC §22)")
    held.add_argument("--eval-stream", metavar="STREAM", type=path,
                      help="a validation set already tokenized (any --stream form), evaluated "
                           "like --eval-source")
    p.add_argument("--seed", type=int, help=f"initialization seed (default {SEED})")
    p.add_argument("--repeat-data", action="store_true",
                   help="read context c as c mod K when the stream is too short")
    p.add_argument("--new-data", action="store_true",
                   help="resume on another stream (lifts only the data identity's stream digest)")
    p.add_argument("--new-learner", action="store_true",
                   help="resume with another learning rate, schedule or clip (lifts the learner "
                        "identity's hyperparameters, never its precision)")
    p.add_argument("--blas-threads", type=int, metavar="N",
                   help="threads of NumPy's BLAS for the host's products (default: "
                        "OPENBLAS_NUM_THREADS or OMP_NUM_THREADS when set, else 1, the "
                        "fastest on a busy machine; the README says why)")
    p.add_argument("--tensorboard", metavar="DIR", type=path,
                   help="write every step's loss, learning rate, gradient norm, tokens/s, MFU "
                        "and device memory, and every held-out loss, as TensorBoard event files "
                        "in DIR, flushed at each publication (default: RUN_DIR/tb; "
                        "--no-tensorboard: none)")
    p.add_argument("--no-tensorboard", dest="tensorboard", action="store_const", const=False,
                   help=argparse.SUPPRESS)
    p.add_argument("--wandb", metavar="PROJECT",
                   help="log the same numbers to Weights & Biases project PROJECT (needs the "
                        "wandb package; its own settings hold, WANDB_MODE=offline say; "
                        "--no-wandb turns a remembered one off)")
    p.add_argument("--no-wandb", dest="wandb", action="store_const", const=False,
                   help=argparse.SUPPRESS)
    p.add_argument("--peak-tflops", type=float, metavar="X",
                   help="the device's peak dense bf16 TFLOP/s for the MFU (default: the "
                        "README's table by the GPU's name; none on the CPU or MLX)")
    p.add_argument("--no-sample", action="store_true", help="do not print a sample at the end")
    p.add_argument("--prompt", metavar="TEXT",
                   help="the sample's prompt (default: the first line of the stream's last "
                        "context, held out from training)")
    from coppelius.train import main  # the run loop, imported with the command line

    p.set_defaults(func=main)
