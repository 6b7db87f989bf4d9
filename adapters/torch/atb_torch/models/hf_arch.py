"""The built-in Hugging Face families, now in the core (:mod:`atbcore.models.hf_arch`)."""

from atbcore.models.hf_arch import *  # noqa: F401,F403
from atbcore.models.hf_arch import __all__  # noqa: F401
