"""The benchmark's baseline servers (FastAPI, Ray Serve).  Part of the source tree
only: the wheel leaves this package out (see pyproject.toml), so ``redbatch bench``
runs from a checkout."""
