"""jaxckpt: asynchronous, exact, resharding checkpoints for JAX training, over Orbax.

The public API is what this module re-exports; everything else may change.
"""

from jaxckpt import errors as errors
from jaxckpt.manager import CheckpointManager as CheckpointManager
from jaxckpt.manager import Restored as Restored
from jaxckpt.policy import RetentionPolicy as RetentionPolicy
from jaxckpt.policy import SavePolicy as SavePolicy

__version__ = "0.1.0"
