import sys

from redbatch.cli import main

sys.exit(main())
