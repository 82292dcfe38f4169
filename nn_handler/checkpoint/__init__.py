"""Checkpoints: atomic files, safe loading, prefix-tolerant weights, RNG states, rotation.

The Trainer's checkpoints (what they hold, how a run resumes) are in
``nn_handler.training.checkpointing``; this layer knows nothing of the Trainer.
"""

from nn_handler.checkpoint.io import load_file
from nn_handler.checkpoint.manager import CheckpointManager
from nn_handler.checkpoint.model_state import (
    load_model_state,
    model_state_dict,
    strip_wrapper_prefixes,
)
from nn_handler.checkpoint.naming import restart_count
from nn_handler.checkpoint.opening import Opened, open_checkpoint
from nn_handler.checkpoint.rng import capture_rng, restore_rng
from nn_handler.checkpoint.store.files import atomic_save, remove_orphans

__all__ = [
    "CheckpointManager",
    "Opened",
    "atomic_save",
    "capture_rng",
    "load_file",
    "load_model_state",
    "model_state_dict",
    "open_checkpoint",
    "remove_orphans",
    "restart_count",
    "restore_rng",
    "strip_wrapper_prefixes",
]
