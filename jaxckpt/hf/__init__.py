"""Hugging Face safetensors: export a checkpoint or a live state, import onto a mesh.

`export_safetensors`, `save_safetensors`, `load_safetensors`, `NameMap` and `ExportResult`
are public (re-exported by `jaxckpt`); the modules here are not:

- `_format`: the safetensors file format (headers, dtypes, reading and writing bytes);
- `_names`: name maps (rename, split, reshape, transpose, scale, drop);
- `_files`: the planning and writing every export shares;
- `_export`, `_live`, `_load`: from a checkpoint, from a live job, onto a mesh.
"""

from jaxckpt.hf._export import export_safetensors as export_safetensors
from jaxckpt.hf._files import ExportResult as ExportResult
from jaxckpt.hf._live import save_safetensors as save_safetensors
from jaxckpt.hf._load import load_safetensors as load_safetensors
from jaxckpt.hf._names import NameMap as NameMap
