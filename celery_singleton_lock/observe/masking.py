"""Passwords of the lock Redis never shown where Celery prints configuration.

Celery's ``filter_hidden_settings`` (used by ``celery inspect conf``, ``celery
report`` and Flower's worker config page) hides settings by name and masks the
password of ``broker_url`` and ``*backend*`` URLs only: ``singleton_redis_url``
would be printed password and all. :func:`install` wraps that one function so
our settings go out masked; every other setting is left to Celery's own rules.

No Celery import at module level: :func:`mask_url` serves the CLI and the
checks too, which must work without touching Celery's internals.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "********"

#: option names (in ``singleton_redis_options``) whose values are secrets
_SECRET_NAME = re.compile(r"pass|secret|token|credential|auth", re.IGNORECASE)
_URL_SETTINGS = ("singleton_redis_url",)
_OPTION_SETTINGS = ("singleton_redis_options",)

_MARK = "_celery_singleton_lock_masking"


def mask_url(url: str) -> str:
    """``url`` with its password (userinfo or ``?password=``) replaced by a mask.

    Fails closed: a URL that cannot be parsed is not shown at all.
    """
    if "://" not in url:
        return url
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, host = netloc.rsplit("@", 1)
            user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
            # "redis://secret@host" is a password alone in redis-py
            netloc = f"{user}:{MASK}@{host}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(_SECRET_NAME.search(k) for k, _ in pairs):
                query = urlencode(
                    [(k, MASK if _SECRET_NAME.search(k) else v) for k, v in pairs], safe="*")
        if netloc == parts.netloc and query == parts.query:
            return url  # nothing to hide: as given (urlunsplit drops unix:///'s empty host)
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return f"{url.split('://', 1)[0]}://<unparsable url hidden>"


def mask_options(options: Mapping[Any, Any]) -> dict[Any, Any]:
    """Redis client options with every secret masked (nested mappings too)."""
    out: dict[Any, Any] = {}
    for name, value in options.items():
        if isinstance(value, Mapping):
            out[name] = mask_options(value)
        elif isinstance(name, str) and _SECRET_NAME.search(name) and value is not None:
            out[name] = MASK
        elif isinstance(value, str) and "://" in value:
            out[name] = mask_url(value)
        else:
            out[name] = value
    return out


def _ours(name: Any, suffixes: tuple[str, ...]) -> bool:
    # old-style upper-case names and namespaced ones (CELERY_SINGLETON_REDIS_URL)
    return isinstance(name, str) and name.lower().endswith(suffixes)


def mask_settings(conf: Mapping[Any, Any]) -> dict[Any, Any]:
    """A settings table with our Redis URL and options masked, the rest as given."""
    out: dict[Any, Any] = {}
    for name, value in conf.items():
        if _ours(name, _URL_SETTINGS) and isinstance(value, str):
            out[name] = mask_url(value)
        elif _ours(name, _OPTION_SETTINGS) and isinstance(value, Mapping):
            out[name] = mask_options(value)
        else:
            out[name] = value
    return out


def install() -> None:
    """Make Celery's printed configuration mask our secrets; safe to call again.

    ``Settings.table`` looks ``filter_hidden_settings`` up in its module at each
    call, so replacing that one name covers ``inspect conf``, ``report`` and
    Flower (which asks the workers through ``inspect conf``).
    """
    from celery.app import utils

    current: Callable[[Mapping[Any, Any]], dict[Any, Any]] = utils.filter_hidden_settings
    if getattr(current, _MARK, False):
        return

    def filter_hidden_settings(conf: Mapping[Any, Any]) -> dict[Any, Any]:
        return current(mask_settings(conf))

    filter_hidden_settings.__doc__ = current.__doc__
    filter_hidden_settings.__wrapped__ = current  # type: ignore[attr-defined]
    setattr(filter_hidden_settings, _MARK, True)
    utils.filter_hidden_settings = filter_hidden_settings


def installed() -> bool:
    """Whether :func:`install` has wrapped Celery's filter in this process."""
    from celery.app import utils

    return bool(getattr(utils.filter_hidden_settings, _MARK, False))


_URL_PASSWORD = re.compile(r"(\w+://[^:/@\s]*:)[^@\s]*@")
#: a secret-named parameter of a URL's query string (``?password=...``)
_QUERY_SECRET = re.compile(
    r"([?&][^=&#\s]*(?:pass|secret|token|credential|auth)[^=&#\s]*=)[^&#\s]*", re.IGNORECASE)


def scrub(text: str) -> str:
    """Any URL password in a message masked, in the user part or the query
    string (an error may quote a setting)."""
    return _QUERY_SECRET.sub(rf"\1{MASK}", _URL_PASSWORD.sub(rf"\1{MASK}@", text))
