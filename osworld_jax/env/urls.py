"""URL equality as upstream OSWorld's ``compare_urls`` decides it (no jax)."""

from __future__ import annotations

import functools
import re
import urllib.parse
from typing import Any

_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+\-.]*://")


@functools.cache
def _tld_extract() -> Any:
    import tldextract

    # The bundled public-suffix snapshot: never fetched (no network), never cached on disk.
    return tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)


def _norm_url(url: str, full: bool) -> str:
    p = urllib.parse.urlparse(url if _SCHEME.match(url) else f"http://{url}")
    ext = _tld_extract()(p.netloc.lower())
    sub = "" if ext.subdomain == "www" else ext.subdomain
    host = f"{sub}.{ext.domain}" if sub else ext.domain
    path = "" if p.path == "/" else p.path
    rest = (p.params, p.query, p.fragment) if full else ("", "", "")
    return urllib.parse.urlunparse((p.scheme.lower(), host, path, *rest))


def compare_urls(url1: str | None, url2: str | None, full: bool = True) -> bool:
    """Upstream ``compare_urls``: the two URLs are equal after normalisation.

    A missing scheme becomes ``http``; the host is lower-cased and reduced to its registrable
    name without the public suffix (``www.airbnb.com.sg`` -> ``airbnb``; other subdomains and
    the port's host stay, the port goes); a path of ``/`` is empty. ``full=False`` ignores
    params, query and fragment. ``None`` equals only ``None``.
    """
    if url1 is None or url2 is None:
        return url1 == url2
    return _norm_url(url1, full) == _norm_url(url2, full)
