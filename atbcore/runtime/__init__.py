"""Runtime: configuration (``init``), compatibility checks, the scheduler, the memory
planner, the plan cache, the executor and the profiler.

The planning/execution names are imported lazily: the executor depends on the graph
package, which itself imports the runtime configuration.
"""

from importlib import import_module
from typing import Any

from .config import check_compatibility, get_config, init

_LAZY = {
    "schedule": "scheduler", "plan_memory": "planner", "MemoryPlan": "planner",
    "PlanCache": "plan_cache", "build_plan": "executor", "ExecPlan": "executor",
    "Profiler": "profiler",
}

__all__ = ["init", "get_config", "check_compatibility", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
