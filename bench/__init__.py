"""fa2cupy_bench: what a user runs to measure fa2cupy, installed from ``bench/`` (see pyproject.toml's package-dir).

``harness`` is the benchmark harness behind ``fa2cupy bench``. The scripts beside it (``window_speed.py``,
``varlen_speed.py``) run from a source checkout; ``bench/dev/`` holds developer tools and is not installed.
"""
