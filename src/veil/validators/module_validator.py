"""``ModuleValidator``: Opacus's validator interface, answered by :func:`veil.validate` and :func:`veil.fix`.

No rules of its own: the problems are exactly veil's (BatchNorm and other batch statistics, tracked
running statistics, parameters without a per-sample clipping rule), so what ``ModuleValidator``
accepts is what ``make_private`` accepts, except the forward probe (examples mixed in user code),
which needs real batches and runs in ``make_private``.
"""

from __future__ import annotations

from torch import nn

from veil.errors import ModelNotSupportedError, Problem
from veil.validation import fix as _fix
from veil.validation import validate as _validate

__all__ = ["ModuleValidator"]


class ModuleValidator:
    """``validate`` / ``is_valid`` / ``fix`` / ``fix_and_validate`` as Opacus users call them."""

    @staticmethod
    def validate(module: nn.Module, *, strict: bool = False) -> list[Problem]:
        """Every problem at once; with ``strict=True`` a non-empty list is raised as
        :class:`~veil.errors.ModelNotSupportedError` (a ``ValueError``) instead."""
        problems = _validate(module)
        if strict and problems:
            raise ModelNotSupportedError(problems)
        return problems

    @staticmethod
    def is_valid(module: nn.Module) -> bool:
        """True when :meth:`validate` finds nothing."""
        return not _validate(module)

    @staticmethod
    def fix(module: nn.Module, **kwargs: object) -> nn.Module:
        """A fixed *copy* (BatchNorm → GroupNorm with the affine weights copied, ...); build the optimizer
        from the returned model. Opacus's fixer options are not needed and are refused if given."""
        if kwargs:
            from veil.errors import InvalidParameterError

            raise InvalidParameterError(
                "fix options",
                sorted(kwargs),
                "veil's fix chooses the GroupNorm group count itself (the largest divisor of the channels "
                "up to 32) and has no other options",
                "call ModuleValidator.fix(model) without options",
            )
        return _fix(module)

    @staticmethod
    def fix_and_validate(module: nn.Module) -> nn.Module:
        """:meth:`fix`, then :meth:`validate` with ``strict=True``; returns the fixed copy."""
        fixed = _fix(module)
        ModuleValidator.validate(fixed, strict=True)
        return fixed
