"""The one pytree shape of the package: a record whose children are its ``_FIELDS``, in order."""

from __future__ import annotations


class FieldsPytree:
    """Base of ``VerifyPlan``, ``WritePlan`` and ``ViolationLog``: children are the attributes named by
    the subclass's ``_FIELDS`` (in that order, the constructor's positional order too); no aux data.
    Subclasses still carry ``@jax.tree_util.register_pytree_node_class``."""

    _FIELDS: tuple = ()

    def tree_flatten(self):
        return tuple(getattr(self, f) for f in self._FIELDS), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls(*children)

    def __repr__(self):
        return f"{type(self).__name__}(" + ", ".join(
            f"{f}={getattr(getattr(self, f), 'shape', getattr(self, f))}" for f in self._FIELDS) + ")"
