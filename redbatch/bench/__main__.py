import sys

if "--stream" in sys.argv[1:]:  # the streaming benchmark (redbatch.bench.stream)
    from redbatch.bench.stream import main

    sys.exit(main([a for a in sys.argv[1:] if a != "--stream"]))

from redbatch.bench.run import main

sys.exit(main())
