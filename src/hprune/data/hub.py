"""Hugging Face Hub models (`hprune data fetch hf=ORG/NAME`), downloaded file by file into
`<paths.models_root>/hub/<ORG>--<NAME>/`, the folder save_pretrained writes; every verb takes it as ckpt= (it is
imported once, backend/hf.py).

config.json first (to know the family and so the tokenizer's files), then the weights (model.safetensors, else
pytorch_model.bin), then the tokenizer's files. Downloads resume and retry as the WMT corpora do
(data/download.py) in `<folder>.partial/`, renamed to the folder once complete; `mirror` replaces
https://huggingface.co and `revision` pins a commit. hub.json records where each file came from and its sha256.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from ..errors import UserError
from ..files import write_json
from .download import Remote, RemoteMissing, fetch, file_digest

HUB_URL = "https://huggingface.co"
RECORD = "hub.json"


def fetch_hub(repo: str, models_root: Path, mirror: Optional[str] = None, revision: str = "main",
              retries: int = 4) -> Path:
    """The model folder of Hub repository `repo` (e.g. Helsinki-NLP/opus-mt-en-de); downloaded unless there."""
    from ..backend import hf  # torch and fairseq: only for a fetch

    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo or ""):
        raise UserError(f"hf={repo!r} is not a Hub repository; pass hf=ORG/NAME, e.g. hf=Helsinki-NLP/opus-mt-en-de")
    folder = Path(models_root).expanduser().absolute() / "hub" / repo.replace("/", "--")
    if (folder / RECORD).is_file():
        return folder
    if folder.exists():
        raise UserError(f"{folder} exists but was not fetched by hprune (no {RECORD}); pass it as ckpt= as it is, or "
                        "move it away and fetch again")
    partial = folder.with_name(folder.name + ".partial")  # kept across runs: an interrupted fetch resumes
    base = f"{(mirror or HUB_URL).rstrip('/')}/{repo}/resolve/{revision}/"

    def get(name: str) -> Path:
        return fetch(Remote(url=base + name), partial / name, retries=retries)

    def first(names: tuple[str, ...], what: str) -> Optional[Path]:
        for name in names:
            try:
                return get(name)
            except RemoteMissing:
                continue
        if what:
            raise UserError(f"{base} has no {what} ({' or '.join(names)}); is {repo} a translation model?")
        return None

    family = hf.FAMILIES[hf.family_of(hf.read_config(first(("config.json",), "config.json").parent), repo)]
    first(hf.WEIGHTS, "weights")
    for name in family.files:
        first((name,), f"{family.model_class} tokenizer file")
    for name in family.optional:
        first((name,), "")
    files = sorted(p.name for p in partial.iterdir() if not p.name.endswith((".part", ".verified")))
    write_json(partial / RECORD, {"repo": repo, "revision": revision, "url": base,
                                  "sha256": {name: file_digest(partial / name, "sha256") for name in files}})
    os.replace(partial, folder)
    return folder

