"""jaxckpt: asynchronous, exact, resharding checkpoints for JAX training, over Orbax.

The public API is what this module re-exports; everything else may change.
"""

from jaxckpt import errors as errors
from jaxckpt._checkpoint import Checkpoint as Checkpoint
from jaxckpt._checkpoint import open as open
from jaxckpt._checkpoint import verify as verify
from jaxckpt._diff import StepDiff as StepDiff
from jaxckpt._diff import diff as diff
from jaxckpt._integrity import StepReport as StepReport
from jaxckpt._local import LocalTier as LocalTier
from jaxckpt._manager import CheckpointManager as CheckpointManager
from jaxckpt._plan import ProcessPlan as ProcessPlan
from jaxckpt._plan import RestorePlan as RestorePlan
from jaxckpt._policy import RetentionPolicy as RetentionPolicy
from jaxckpt._policy import SavePolicy as SavePolicy
from jaxckpt._preemption import PreemptionPolicy as PreemptionPolicy
from jaxckpt._read_step import Restored as Restored
from jaxckpt._standalone import copy_step as copy_step
from jaxckpt._targets import restore_or_init as restore_or_init
from jaxckpt._targets import target_from_flax as target_from_flax
from jaxckpt._targets import target_like as target_like
from jaxckpt._targets import target_on_mesh as target_on_mesh
from jaxckpt._to_orbax import export_orbax as export_orbax
from jaxckpt._tree import leaf_name as leaf_name
from jaxckpt.hf import ExportResult as ExportResult
from jaxckpt.hf import NameMap as NameMap
from jaxckpt.hf import export_safetensors as export_safetensors
from jaxckpt.hf import load_safetensors as load_safetensors
from jaxckpt.hf import save_safetensors as save_safetensors

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "ExportResult",
    "LocalTier",
    "NameMap",
    "PreemptionPolicy",
    "ProcessPlan",
    "RestorePlan",
    "Restored",
    "RetentionPolicy",
    "SavePolicy",
    "StepDiff",
    "StepReport",
    "copy_step",
    "diff",
    "errors",
    "export_orbax",
    "export_safetensors",
    "leaf_name",
    "load_safetensors",
    "open",
    "restore_or_init",
    "save_safetensors",
    "target_from_flax",
    "target_like",
    "target_on_mesh",
    "verify",
]

__version__ = "0.1.0"
