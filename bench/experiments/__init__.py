"""One-off experiments, apart from the suite: ``python -m bench`` never runs them.

Each module is run on its own (``PYTHONPATH=. python -m bench.experiments.<name>``) and keeps the
results it was cited for under ``bench/experiments/results/``.

  ffi_variants  patched builds of the native CPU module timed against the shipped ``impl='ffi'``
"""
