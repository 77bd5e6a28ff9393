import signal
import sys

# A Ctrl-C while the command line itself is imported: one line, as main says.
# The interrupt may land inside a library's import (NumPy's C modules), which
# then fails with an error of its own instead of KeyboardInterrupt: so the
# handler notes that it ran, and any failure after it is the interrupt.
interrupted = []


def on_interrupt(signum, frame):
    interrupted.append(signum)
    raise KeyboardInterrupt


signal.signal(signal.SIGINT, on_interrupt)
try:
    from coppelius.cli import main
except BaseException:
    if not interrupted:
        raise
    print("coppelius: interrupted", file=sys.stderr)
    sys.exit(130)
signal.signal(signal.SIGINT, signal.default_int_handler)

sys.exit(main())
