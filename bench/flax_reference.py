"""diffusers' and transformers' Flax classes as a benchmark's point of comparison (the
worker uses neither): they warn on every use and about the disabled safety checker; keep
that out of the figures."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_diffusers() -> Iterator[None]:
    import diffusers.utils.logging as dlog
    import transformers.utils.logging as tlog

    old = dlog.get_verbosity(), tlog.get_verbosity()
    dlog.set_verbosity_error()
    tlog.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Flax classes are deprecated.*")
            warnings.filterwarnings("ignore", category=FutureWarning, module="diffusers")
            yield
    finally:
        dlog.set_verbosity(old[0])
        tlog.set_verbosity(old[1])
