"""Quantization schemes for expert weights in transit: bf16 (lossless), int8 (per row), bnb8, int4, nf4, mxfp4 (as stored).

Pure functions over tensors; no knowledge of tiers, files or streams.
"""
from . import bnb as _bnb  # noqa: F401  (registers "bnb8")
from . import int4 as _int4  # noqa: F401  (registers "int4")
from . import int8 as _int8  # noqa: F401  (registers "int8")
from . import mxfp4 as _mxfp4  # noqa: F401  (registers "mxfp4")
from . import nf4 as _nf4  # noqa: F401  (registers "nf4")
from . import plain as _plain  # noqa: F401  (registers "bf16")
from .core import FieldSpec, QuantizedTensor, Scheme, get_scheme, scheme_names, sqnr_db

__all__ = ["FieldSpec", "QuantizedTensor", "Scheme", "get_scheme", "scheme_names", "sqnr_db"]
