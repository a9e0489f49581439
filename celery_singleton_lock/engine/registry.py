"""One lock engine per app and process: the kind the URL names, made anew after fork.

:func:`connect` picks it by the URL's kind: :class:`~.server.LockEngine` for
one server, a Sentinel-managed primary or a Cluster,
:class:`~.redlock.engine.RedlockEngine` for a quorum of independent masters;
both are an :class:`~.base.Engine`, and each kind is made by the maker its
module registered (:func:`register`, done by the engine package when it is
imported): this module, through which everything above the engine reaches
it, knows the interface only. :func:`engine_for` keeps one per app in
each process; its replies still owed are read at process exit.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any, Callable, Iterable

from ..config import SingletonConfig, get_config
from ..exceptions import describe
from ..process import PROCESS, ForkSafeLock
from ..urls import mode_of
from .base import Engine

logger = logging.getLogger("celery_singleton_lock")


#: the kind of deployment a URL names (:func:`..urls.mode_of`) -> what makes its engine
_makers: dict[str, Callable[[SingletonConfig], Engine]] = {}


def register(modes: Iterable[str], make: Callable[[SingletonConfig], Engine]) -> None:
    """``make(config)`` makes the engine of a URL of any of ``modes``."""
    for mode in modes:
        _makers[mode] = make


def connect(config: SingletonConfig) -> Engine:
    """A new engine for ``config.redis_url`` (no connection is opened yet)."""
    mode = mode_of(config.redis_url)
    make = _makers.get(mode)
    if make is None:
        raise ValueError(f"no lock engine for {mode or 'this kind of'} URL "
                         f"{config.redis_url.split('://', 1)[0]}://")
    return make(config)


_engines: weakref.WeakKeyDictionary[Any, tuple[int, Engine]] = weakref.WeakKeyDictionary()
_engines_lock = ForkSafeLock()


def engine_for(app: Any) -> Engine:
    """The engine of ``app`` in this process (a new one after fork)."""
    generation = PROCESS.generation
    entry = _engines.get(app)
    if entry is None or entry[0] != generation:
        with _engines_lock:
            entry = _engines.get(app)
            if entry is None or entry[0] != generation:
                entry = (generation, connect(get_config(app)))
                _engines[app] = entry
                _register_exit_settle()
    return entry[1]


def settle_all() -> None:
    """Read the replies every engine of this process still owes (at process exit)."""
    generation = PROCESS.generation
    for entry in list(_engines.values()):
        if entry[0] == generation:
            try:
                entry[1].settle()
            except Exception as exc:  # exiting: say so, never raise
                logger.warning("Could not read a lock reply at exit: %s", describe(exc))


_exit_settle_registered = False


def _register_exit_settle() -> None:
    global _exit_settle_registered
    if not _exit_settle_registered:
        _exit_settle_registered = True
        atexit.register(settle_all)


def forget_engine(app: Any) -> None:
    with _engines_lock:
        _engines.pop(app, None)
