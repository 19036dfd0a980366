"""Opacus's ``opacus.utils`` names that user code touches (``batch_memory_manager``)."""
