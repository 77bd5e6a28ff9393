import sys

from conformance.command import main

sys.exit(main())
