"""Fetching http(s) images for chat requests: off by default, on for the domains `--allowed-media-domains` names.

A fetch has a timeout and a size cap and never follows a redirect off the allowed domains (urllib follows
redirects, so the final URL is checked again); every failure is a ValueError naming the URL, which the chat serving
turns into a 400 naming the content part.
"""
from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

MAX_MEDIA_BYTES = 20 << 20


def allowed(url: str, domains: list[str]) -> bool:
    host = (urllib.parse.urlparse(url).hostname or "").lower()
    return any(host == d or host.endswith("." + d) for d in domains)


def make_fetcher(domains: list[str], *, timeout: float = 10.0, max_bytes: int = MAX_MEDIA_BYTES
                 ) -> Callable[[str], bytes]:
    """url -> bytes for http(s) URLs on `domains` (a domain allows its subdomains too)."""
    domains = [d.strip().lower() for d in domains if d.strip()]

    def fetch(url: str) -> bytes:
        if urllib.parse.urlparse(url).scheme not in ("http", "https") or not allowed(url, domains):
            raise ValueError(f"image_url {url[:80]!r}: the domain is not in --allowed-media-domains {domains}")
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (scheme checked above)
                if not allowed(r.geturl(), domains):
                    raise ValueError(f"image_url {url[:80]!r}: redirected off the allowed domains")
                data = r.read(max_bytes + 1)
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise ValueError(f"image_url {url[:80]!r}: could not be fetched ({e})") from None
        if len(data) > max_bytes:
            raise ValueError(f"image_url {url[:80]!r}: larger than {max_bytes} bytes")
        return data
    return fetch
