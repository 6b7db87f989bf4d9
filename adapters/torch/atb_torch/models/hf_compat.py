"""What differs between the supported ``transformers`` releases, in one place.

The compiled models follow Hugging Face's ``generate`` contract from the oldest
supported release to the newest; the names that moved between them are looked up
here once rather than at every call site:

* the KV cache keyword: ``past_key_values`` up to 5.23, ``cache`` from 5.24 (which
  still accepts the old name in model outputs, with a deprecation warning);
* :func:`log_once`: a fallback to Hugging Face's own code is logged once per reason,
  not once per token.
"""

from __future__ import annotations

import functools
from typing import Any

from atbcore.log import logger

__all__ = ["CACHE_NAMES", "cache_kwarg", "output_with_cache", "log_once"]

# every name a cache has been passed under; forward accepts each of them
CACHE_NAMES = ("cache", "past_key_values")


@functools.lru_cache(maxsize=None)
def cache_kwarg() -> str:
    """The keyword ``generate`` passes the cache under in the installed release."""
    from transformers.generation import utils

    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


@functools.lru_cache(maxsize=None)
def _cache_field(output_cls: type) -> str:
    fields = getattr(output_cls, "__dataclass_fields__", {})
    return "cache" if "cache" in fields else "past_key_values"


def output_with_cache(output_cls: type, cache: Any, **fields: Any) -> Any:
    """``output_cls(**fields)`` with ``cache`` under the field name this release uses
    (``generate`` reads it back from there for the next step)."""
    return output_cls(**{_cache_field(output_cls): cache}, **fields)


_LOGGED: set[str] = set()


def log_once(message: str) -> None:
    """Log a fallback to Hugging Face's own code: at INFO the first time for each
    reason, at DEBUG after that (the result is the same, only the speed differs; the
    C kernels' fallbacks are logged the same way)."""
    logger.log(10 if message in _LOGGED else 20, message)
    _LOGGED.add(message)
