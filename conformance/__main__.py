import sys

from coppelius.conformance.command import main

sys.exit(main())
