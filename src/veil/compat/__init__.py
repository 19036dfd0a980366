"""Compatibility with other libraries' public APIs, mapped onto veil's own objects."""
