"""The architecture registry, now in the core (:mod:`atbcore.models.arch`): the same
objects under their old import path, so plugins written against
``atb_torch.models.arch`` keep working."""

from atbcore.models.arch import *  # noqa: F401,F403
from atbcore.models.arch import __all__  # noqa: F401
