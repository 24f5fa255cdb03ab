"""jaxckpt: asynchronous, exact, resharding checkpoints for JAX training, over Orbax.

The public API is what this module re-exports; everything else may change.
"""

from jaxckpt import errors as errors
from jaxckpt._diff import StepDiff as StepDiff
from jaxckpt._diff import diff as diff
from jaxckpt._hf_export import export_safetensors as export_safetensors
from jaxckpt._hf_files import ExportResult as ExportResult
from jaxckpt._hf_import import load_safetensors as load_safetensors
from jaxckpt._hf_live import save_safetensors as save_safetensors
from jaxckpt.integrity import StepReport as StepReport
from jaxckpt.integrity import verify as verify
from jaxckpt.manager import CheckpointManager as CheckpointManager
from jaxckpt.manager import Restored as Restored
from jaxckpt.names import NameMap as NameMap
from jaxckpt.plan import ProcessPlan as ProcessPlan
from jaxckpt.plan import RestorePlan as RestorePlan
from jaxckpt.policy import RetentionPolicy as RetentionPolicy
from jaxckpt.policy import SavePolicy as SavePolicy
from jaxckpt.preemption import PreemptionPolicy as PreemptionPolicy
from jaxckpt.targets import target_from_flax as target_from_flax
from jaxckpt.targets import target_like as target_like
from jaxckpt.targets import target_on_mesh as target_on_mesh

__version__ = "0.1.0"
