import sys

from pdsdk.cli import main

sys.exit(main())
