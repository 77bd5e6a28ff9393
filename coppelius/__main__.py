import sys

try:  # a Ctrl-C while the command line itself is imported: one line, as main says
    from coppelius.cli import main
except KeyboardInterrupt:
    print("coppelius: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
