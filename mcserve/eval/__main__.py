import sys

from mcserve.eval.cli import main

sys.exit(main())
