"""Opacus's ``opacus.validators`` name: :class:`ModuleValidator` over :mod:`veil.validation`."""

from __future__ import annotations

from veil.validators.module_validator import ModuleValidator

__all__ = ["ModuleValidator"]
