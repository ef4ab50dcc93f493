"""jax_kvcanary benchmarks: ``python -m bench [--quick|--medium|--full] [--platform cpu|gpu]``.

``bench.run(argv)`` runs the suite with command-line style arguments and returns the result dict
(what is written to ``<out>/<platform>-<date>.json``); the GPU scripts call it with
``["--platform", "gpu", ...]``. The package measured is the installed ``jax_kvcanary`` (the source
tree lives under ``src/``, so running from the repository root cannot shadow it).
"""


def run(argv=None):
    from .cli import run as _run
    return _run(argv)


__all__ = ["run"]
