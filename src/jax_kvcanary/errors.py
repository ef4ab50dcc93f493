"""Exception classes raised by argument checks."""


class KvCanaryTypeError(TypeError, ValueError):
    """A wrong type or dtype. Subclasses ValueError too, so ``except ValueError`` (the upstream habit)
    also catches it."""
