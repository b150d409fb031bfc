"""Where a remote dataset's cache lives: one sub-directory per dataset in the cache directory.

The cache directory itself is a resolved setting (:attr:`~.settings.StorageSettings.cache_dir`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from .backends import backend_class

__all__ = ["dataset_cache_key"]


def dataset_cache_key(url: str, storage_options: Mapping[str, Any] | None) -> str:
    """Return a short hash naming a dataset's cache directory: of its URL and endpoint.

    The same ``s3://bucket/x`` on two servers must not share a cache: the endpoint is taken
    from ``storage_options``, else from where the URL's backend finds it (for ``s3://``, the
    environment variables botocore reads: ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``).
    """
    endpoint = backend_class(url).cache_endpoint(storage_options or {})
    text = json.dumps([url.rstrip("/"), endpoint])
    return hashlib.sha256(text.encode()).hexdigest()[:24]
