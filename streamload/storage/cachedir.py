"""Where a remote dataset's cache lives: the cache directory and one sub-directory per dataset."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from .. import _env
from .backends import backend_class

__all__ = ["dataset_cache_key", "default_cache_dir"]


def default_cache_dir() -> str:
    """``$STREAMLOAD_CACHE`` if set, else ``$XDG_CACHE_HOME/streamload`` or ``~/.cache/streamload``."""
    return _env.cache_dir()


def dataset_cache_key(url: str, storage_options: Mapping[str, Any] | None) -> str:
    """Return a short hash naming a dataset's cache directory: of its URL and endpoint.

    The same ``s3://bucket/x`` on two servers must not share a cache: the endpoint is taken
    from ``storage_options``, else from where the URL's backend finds it (for ``s3://``, the
    environment variables botocore reads: ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``).
    """
    endpoint = backend_class(url).cache_endpoint(storage_options or {})
    text = json.dumps([url.rstrip("/"), endpoint])
    return hashlib.sha256(text.encode()).hexdigest()[:24]
