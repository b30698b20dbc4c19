import sys

from redbatch.bench.run import main

sys.exit(main())
