"""The benchmark suite (``redbatch bench``, ``scripts/bench``): needs the ``bench``
extra (FastAPI for the naive baseline, matplotlib for the plot) and ``wrk``."""
