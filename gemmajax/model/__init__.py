"""The Gemma text decoder (pure functions over pytrees) and checkpoint loading."""
from gemmajax.model.loader import CheckpointError, Model, load_model

__all__ = ["CheckpointError", "Model", "load_model"]
