"""Object-store URLs as job paths: parsing, and confining a tenant's URLs to its prefix.

Pure string work, no I/O (object_store.py does the copying). A URL is `SCHEME://BUCKET/KEY`
with SCHEME one of SCHEMES. It is taken as written, never normalized: an object store has no
`..`, so a key segment `..` (or `.`, or an empty one from `//`) would name a different object
than a reader of the URL expects; such URLs are refused rather than guessed at. Characters that
fsspec treats as globs or URL syntax (`*?[]#`) are refused too, so a job names exactly one
object or prefix.
"""

from __future__ import annotations

import dataclasses

# Schemes a job may use; fsspec maps each onto a filesystem package (object_store.py).
SCHEMES = ("gs", "s3")
_SPECIAL = set("*?[]#\\\0")


@dataclasses.dataclass(frozen=True)
class Url:
    scheme: str
    bucket: str
    # '/'-joined key segments, no leading or trailing '/'; "" for the bucket itself.
    key: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}" + (f"/{self.key}" if self.key else "")

    def child(self, segment: str) -> Url:
        return Url(self.scheme, self.bucket, f"{self.key}/{segment}" if self.key else segment)

    def is_below(self, prefix: Url) -> bool:
        """Strictly below: the prefix itself is not (as a destination it would be replaced
        whole, as with a tenant's directory under --jobs-root)."""
        if (self.scheme, self.bucket) != (prefix.scheme, prefix.bucket):
            return False
        if not prefix.key:
            return bool(self.key)
        return self.key.startswith(prefix.key + "/")


def is_url(value: str) -> bool:
    """Whether a job path is a URL rather than a server path."""
    return "://" in value


def parse(value: str, what: str) -> Url:
    """The URL `value` (a job's `what`: source, destination, --jobs-url-root).

    Raises:
      ValueError: another scheme, no bucket, or a segment that could name another object.
    """
    scheme, _, rest = value.partition("://")
    if scheme not in SCHEMES:
        raise ValueError(
            f"{what} {value!r}: the scheme {scheme + '://'!r} is not supported; object-store "
            f"URLs must start with {' or '.join(s + '://' for s in SCHEMES)}"
        )
    bad = sorted(_SPECIAL.intersection(rest))
    if bad:
        raise ValueError(
            f"{what} {value!r} contains {''.join(bad)!r}; object-store job URLs may not contain "
            "any of * ? [ ] # \\ (they would be read as patterns or URL syntax)"
        )
    bucket, _, key = rest.rstrip("/").partition("/")
    segments = key.split("/") if key else []
    if not bucket or any(s in ("", ".", "..") for s in segments):
        raise ValueError(
            f"{what} {value!r} is not a plain object-store URL: it needs a bucket "
            f"({scheme}://BUCKET/KEY) and no '..', '.' or empty ('//') segments"
        )
    return Url(scheme, bucket, key)


def parse_roots(values: tuple[str, ...]) -> tuple[Url, ...]:
    """The --jobs-url-root values; raises ValueError naming the bad one."""
    return tuple(parse(v, "--jobs-url-root") for v in values)


def tenant_prefixes(roots: tuple[Url, ...], tenant: str) -> tuple[Url, ...]:
    """`<root>/<tenant>` for each root (the tenant's name already checked as one segment)."""
    return tuple(root.child(tenant) for root in roots)
