"""jax_kvcanary benchmarks (issue 5): ``python -m bench [--quick|--medium|--full] [--platform cpu|gpu]``.

``bench.run(argv)`` runs the suite with command-line style arguments and returns the result dict
(what is written to ``<out>/<platform>-<date>.json``); the GPU scripts call it with
``["--platform", "gpu", ...]``.

Which ``jax_kvcanary`` is measured: ``python -m bench`` from the repository root puts the source tree
first on ``sys.path``. A source tree without a built native module (a clean checkout, as in CI) would
then shadow the installed package and silently lose the ``ffi`` backend, so in that case the installed
package is preferred (the path used is recorded in the output as ``jax_kvcanary_path``).
"""

import glob
import importlib.machinery
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _prefer_installed_package():
    if "jax_kvcanary" in sys.modules:
        return
    if glob.glob(os.path.join(_ROOT, "jax_kvcanary", "_kvcanary*")):
        return  # a development build inside the tree: measure that

    def is_root(p):
        try:
            return os.path.samefile(p or os.getcwd(), _ROOT)
        except OSError:
            return False

    rest = [p for p in sys.path if not is_root(p)]
    spec = importlib.machinery.PathFinder.find_spec("jax_kvcanary", rest)
    if spec is not None and spec.submodule_search_locations:
        loc = list(spec.submodule_search_locations)[0]
        if glob.glob(os.path.join(loc, "_kvcanary*")):
            sys.path[:] = rest


_prefer_installed_package()


def run(argv=None):
    from .cli import run as _run
    return _run(argv)


__all__ = ["run"]
