"""Flatten nested tuples/lists/dicts of tensors and rebuild them (module inputs and outputs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor


def flatten(obj: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """Leaves of ``obj`` (tensors and other non-container values) and a function rebuilding it."""
    leaves: list[Any] = []

    def walk(node: Any) -> Callable[[list[Any]], Any]:
        if isinstance(node, (tuple, list)) and not isinstance(node, Tensor):
            parts = [walk(item) for item in node]
            kind = type(node)
            if isinstance(node, tuple) and hasattr(node, "_fields"):  # namedtuple

                def build_named(src: list[Any]) -> Any:
                    return kind(*(part(src) for part in parts))

                return build_named

            def build_seq(src: list[Any]) -> Any:
                return kind(part(src) for part in parts)

            return build_seq
        if isinstance(node, dict):
            keys = list(node)
            parts = [walk(node[k]) for k in keys]
            dict_kind = type(node)

            def build_dict(src: list[Any]) -> Any:
                return dict_kind(zip(keys, (part(src) for part in parts), strict=True))

            return build_dict
        position = len(leaves)
        leaves.append(node)

        def build_leaf(src: list[Any]) -> Any:
            return src[position]

        return build_leaf

    build = walk(obj)
    return leaves, build


def map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor leaf."""
    leaves, build = flatten(obj)
    return build([fn(leaf) if isinstance(leaf, Tensor) else leaf for leaf in leaves])
