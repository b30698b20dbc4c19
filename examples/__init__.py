"""Runnable examples, ported from Ray Serve's batching tutorials.

* ``examples.adder``: the vectorized adder (``@serve.batch(max_batch_size=4)``).
* ``examples.doubler``: calling a model from Python with futures (Ray's ``.remote()``).
* ``examples.house_price``: a torch regression model behind the HTTP gateway.

Each module's docstring says how to run it.  Run the commands from the repository
root, so that ``examples`` is importable by the worker processes.
"""
