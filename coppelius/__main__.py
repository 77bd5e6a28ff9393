import sys

from coppelius.cli import main

sys.exit(main())
