"""Hugging Face Hub models (`hprune data fetch hf=ORG/NAME`, or `ckpt=ORG/NAME` in any verb), fetched through
huggingface_hub as from_pretrained fetches them: into the shared Hugging Face cache (HF_HOME, HF_HUB_CACHE), with
the token of HF_TOKEN or `hf auth login` (gated and private models), HF_ENDPOINT (or `mirror=`) for a mirror, and
HF_HUB_OFFLINE=1 answered from the cache. A model already in the cache is not fetched again; an interrupted
download resumes where it stopped (huggingface_hub's `.incomplete` blobs).

Only the files hprune reads are fetched: config.json, the weights (model.safetensors, else pytorch_model.bin) and
the family's tokenizer files (model_folder.py). The snapshot folder is the model folder every verb takes (it is
imported once, backend/hf.py). `<models_root>/hub/<ORG>--<NAME>.json` records the revision asked for, the commit
it resolved to, the endpoint, the snapshot folder and each file's sha256.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

from .errors import UserError
from .files import file_digest, locked, write_json
from .model_folder import HF_CONFIG, HF_FAMILIES, HF_WEIGHTS, HUB_ID, hf_family, read_hf_config

log = logging.getLogger(__name__)
INSTALL = "pip install 'hprune[hf]'"


def _hub():
    try:
        import huggingface_hub
    except ImportError:
        raise UserError(f"fetching from the Hugging Face Hub needs huggingface_hub: {INSTALL}") from None
    return huggingface_hub


def record_path(repo: str, models_root: Path) -> Path:
    return Path(models_root).expanduser().absolute() / "hub" / f"{repo.replace('/', '--')}.json"


def snapshot_repo(folder: Path) -> Optional[str]:
    """The repository (ORG/NAME) whose snapshot `folder` is, where it lies in a Hugging Face cache
    (<cache>/models--ORG--NAME/snapshots/<commit>); None for any other folder."""
    folder = Path(folder)
    cached = folder.parent.parent.name
    if folder.parent.name != "snapshots" or not cached.startswith("models--"):
        return None
    return cached.removeprefix("models--").replace("--", "/", 1)


def fetch_hub(repo: str, models_root: Path, mirror: Optional[str] = None, revision: str = "main",
              retries: int = 4, backoff_s: float = 2.0) -> Path:
    """The model folder (a snapshot in the Hugging Face cache) of Hub repository `repo`, e.g.
    Helsinki-NLP/opus-mt-en-de; downloaded unless the cache holds it. A dropped connection or a server error is
    retried with backoff, each try resuming the partial files."""
    if not HUB_ID.fullmatch(repo or ""):
        raise UserError(f"hf={repo!r} is not a Hub repository; pass hf=ORG/NAME, e.g. hf=Helsinki-NLP/opus-mt-en-de")
    hub = _hub()
    from huggingface_hub import constants, errors

    endpoint = mirror.rstrip("/") if mirror else None  # None: HF_ENDPOINT, else https://huggingface.co
    where = endpoint or constants.ENDPOINT
    record = record_path(repo, models_root)
    for attempt in range(retries + 1):
        try:
            with locked(record):
                folder = _snapshot(hub, repo, revision, endpoint, where)
                write_json(record, {"repo": repo, "revision": revision, "commit": folder.name, "endpoint": where,
                                    "folder": str(folder), "sha256": {p.name: file_digest(p, "sha256")
                                                                      for p in sorted(folder.iterdir()) if p.is_file()}})
            log.info("%s@%s: %s", repo, folder.name[:12], folder)
            return folder
        except errors.GatedRepoError:
            raise UserError(f"{repo} is gated: accept its conditions on the Hub, then set HF_TOKEN=<a token of that "
                            "account> (or run `hf auth login`)") from None
        except errors.RepositoryNotFoundError:
            raise UserError(f"{repo} is not a model on {where}, or it is private: check the name, or set "
                            "HF_TOKEN=<a token with access>") from None
        except errors.RevisionNotFoundError:
            raise UserError(f"{repo} has no revision '{revision}'; pass revision=<a branch, tag or commit>") from None
        except errors.LocalEntryNotFoundError:
            raise UserError(f"{repo} (revision {revision}) is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                            "and HF_HUB_OFFLINE=1 forbids downloading it; fetch it once online, or unset "
                            "HF_HUB_OFFLINE") from None
        except Exception as err:
            if not _transient(err):
                raise
            if attempt == retries:
                raise UserError(f"cannot fetch {repo} from {where} ({_reason(err)}) after {retries + 1} tries; run "
                                "again to resume, check the network, or set HF_ENDPOINT=<a mirror>") from None
            delay = backoff_s * 2 ** attempt
            log.info("retrying %s in %.0f s (%s)", repo, delay, _reason(err))
            time.sleep(delay)
    raise AssertionError("unreachable")


def _snapshot(hub, repo: str, revision: str, endpoint: Optional[str], where: str) -> Path:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:  # no request at all: the cached snapshot of that revision, as hprune fetched it
        folder = Path(hub.hf_hub_download(repo, HF_CONFIG, revision=revision, local_files_only=True)).parent
        _wanted(repo, hf_family(read_hf_config(folder), repo), {p.name for p in folder.iterdir()})
        return folder
    info = hub.HfApi(endpoint=endpoint).model_info(repo, revision=revision)
    # by the revision asked for (not info.sha): the cache then maps it to its commit, which offline runs need
    config = hub.hf_hub_download(repo, HF_CONFIG, revision=revision, endpoint=endpoint)
    files = _wanted(repo, hf_family(read_hf_config(Path(config).parent), repo),
                    {s.rfilename for s in info.siblings or ()})
    folder = Path(hub.snapshot_download(repo, revision=revision, allow_patterns=files, endpoint=endpoint))
    # snapshot_download falls back to whatever the cache holds when the listing fails: check that all came
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise ConnectionError(f"{', '.join(missing)} did not arrive from {where}")
    return folder


def _transient(err: Exception) -> bool:
    """A dropped connection, a timeout or a server error: worth another try."""
    from huggingface_hub import errors

    if isinstance(err, errors.HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        return status is None or status >= 500 or status == 429
    return isinstance(err, (ConnectionError, TimeoutError)) or \
        type(err).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore")


def _reason(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _wanted(repo: str, family: str, present: set) -> list[str]:
    """The files of `repo` hprune reads: config.json, the first weights file there is, the tokenizer's."""
    weights = next((name for name in HF_WEIGHTS if name in present), None)
    if weights is None:
        raise UserError(f"{repo} has no weights ({' or '.join(HF_WEIGHTS)}); is it a translation model?")
    spec = HF_FAMILIES[family]
    missing = spec.missing(present)
    if missing:
        raise UserError(f"{repo} lacks the {spec.model_class} tokenizer file(s) {', '.join(missing)}")
    return [HF_CONFIG, weights, *spec.files, *(name for name in spec.optional + spec.one_of if name in present)]
