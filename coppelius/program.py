"""`coppelius program`: a backend's captured training program as it reports
itself (SPEC 13). By default the compilation debug report
(coppelius.training_compilation.v2: the stages, dnn_plan, lowering_analysis
and memory_analysis); --semantic prints the backend-independent semantic
graph, --plan the executable plan (kernels, products or calls, with their
launch shapes). The program is captured from the preset's initialization and
released again; nothing is trained. A backend that counts its state's bytes
(CUDA: compilation_report()'s state_memory, per rank) adds them to the
report."""

from __future__ import annotations

import json
import sys

from coppelius import accelerated
from coppelius.reference.config import PRECISIONS, PRESETS, Hyper, preset
from coppelius.reference.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("program", help="print a backend's captured training program (SPEC §13)",
                       description="Capture one training step of PRESET at batch B on a backend "
                                   "and print its compilation debug report as JSON: stages, "
                                   "fusion partitions, lowering of each operation, memory plan "
                                   "(SPEC §13). --semantic prints the semantic graph instead, "
                                   "--plan the executable plan.")
    p.add_argument("--backend", metavar="NAME",
                   help=f"backend ({', '.join(accelerated.BACKENDS)}; default: the best "
                        "available)")
    p.add_argument("--preset", metavar="NAME",
                   help=f"model preset ({', '.join(PRESETS)}; default: the main job's, "
                        "coppelius with a GPU, else tiny)")
    p.add_argument("--batch", type=int, default=1, metavar="B",
                   help="contexts per step (default: 1)")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="precision policy (default: bf16 on cupy, else fp32)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--semantic", action="store_true",
                      help="print the semantic graph (the step's operations, backend-independent)")
    what.add_argument("--plan", action="store_true",
                      help="print the executable plan (kernels, products or calls in order)")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.batch < 1:
        raise ConfigError(f"--batch={args.batch}: must be a positive integer")
    if args.preset is None:
        from coppelius.plan import default_preset

        args.preset = default_preset()
    config = preset(args.preset)
    backend = args.backend or accelerated.best_backend()
    module = accelerated.backend_module(backend)  # unknown or unavailable: one line, exit 2
    precision = args.precision or accelerated.capabilities(backend).default_precision
    name = f"{args.preset} B={args.batch} {precision} on {backend}"
    if args.semantic:  # the same graph on every backend: nothing to capture
        from coppelius.reference.semantic import semantic_graph

        sys.stdout.write(semantic_graph(config, args.batch, precision).debug_report_json(name))
        return 0
    from coppelius.reference.params import initialize
    from coppelius.reference.state import State

    program = module.capture(config, Hyper(), precision, args.batch,
                             State.fresh(initialize(config)))
    text = program.debug_report_json(name) if args.plan else \
        program.compilation_debug_report_json(name)
    memory = program.compilation_report().get("state_memory")
    if memory is not None and not args.plan:  # the optimizer state's bytes on this rank (SPEC 23)
        from coppelius.reference.semantic import report_json

        text = report_json({**json.loads(text), "state_memory": memory})
    program.reset()
    sys.stdout.write(text)
    return 0
