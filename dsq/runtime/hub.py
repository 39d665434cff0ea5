"""Models by Hugging Face repo id: `org/name` (an HF model directory), `org/name:QUANT` and
`org/name/file.gguf` (GGUF repos), fetched through huggingface_hub into its own cache (shared with
transformers and the rest), with its progress bars, token (HF_TOKEN, `hf auth login`) and
HF_HUB_OFFLINE. Only the files a model needs are fetched: safetensors, config and tokenizer, or the
GGUF file(s) of one quant; never pickled weights or remote code."""

from __future__ import annotations

import errno
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from dsq.errors import BadModelFile, DiskFull, DsqError, ModelNotFound

_REPO = r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*"
_REPO_ID = re.compile(rf"^(?P<repo>{_REPO})(?::(?P<quant>[\w.-]+)|/(?P<file>[^:]+\.gguf))?$", re.IGNORECASE)
# what an HF model directory needs, at the repo's top level (subfolders hold other formats)
_HF_FILES = re.compile(r"^[^/]+\.(safetensors|json|jinja|model|tiktoken|txt)$")
# weights dsq never fetches: pickles (torch, numpy) and other frameworks' formats
_REFUSED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".pkl", ".npz", ".onnx")
_QUANT = re.compile(r"(?:^|[-._])((?:I?Q|TQ)\d(?:_[A-Z0-9]+)*|BF16|F16|F32|FP16|FP32|FP8|MXFP4)(?=[-._]|$)",
                    re.IGNORECASE)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
_SHA256 = re.compile(r"[0-9a-f]{64}")  # an LFS file's ETag: the SHA-256 of its bytes
_OFFLINE_NOTE = "HF_HUB_OFFLINE=1: using the Hugging Face cache only"


class RepoNotFound(ModelNotFound):
    def __init__(self, repo: str, detail: str):
        super().__init__(f"no Hugging Face repo {repo}{detail}",
                         "check the spelling, or set HF_TOKEN / run `hf auth login` for a private repo")
        self.repo, self.detail = repo, detail


class HubUnreachable(DsqError):
    pass


@dataclass(frozen=True)
class RepoId:
    repo: str
    quant: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        return self.repo + (f":{self.quant}" if self.quant else f"/{self.file}" if self.file else "")


def parse_repo_id(text: str) -> RepoId | None:
    """`org/name`, `org/name:QUANT` or `org/name/file.gguf`; None for anything else."""
    m = _REPO_ID.match(text)
    if m is None or text.startswith((".", "~")) or "//" in text or ".." in text:
        return None
    return RepoId(m["repo"], m["quant"], m["file"])


def fetch(rid: RepoId, revision: str | None = None, console=None) -> Path:
    """The local path of `rid` (an HF model directory, or a .gguf: a split GGUF's first part, its
    other parts beside it), downloaded into the Hugging Face cache unless already there.

    Files download one after another in this thread, so that Ctrl-C stops at once; a file appears
    in the cache only once whole, and a rerun fetches only those still missing."""
    offline = _offline()
    with _hub_errors(rid, revision, offline):
        if offline:
            folder, names = _cached_listing(rid, revision)
            kind, files = pick_files(rid, names)
            paths = [folder / f for f in files]
            if console is not None:
                console.print(f"[dim]{_OFFLINE_NOTE}[/dim]", highlight=False)
        else:
            kind, files = pick_files(rid, _listing(rid, revision))
            paths = _download(rid, files, revision, console)
    if kind == "gguf":
        return paths[0]
    folder = paths[0].parent
    _check_shards(rid, folder)
    return folder


def _download(rid: RepoId, files: list[str], revision: str | None, console) -> list[Path]:
    """Each file into the cache (a cached one at once), with dsq's progress bars: bars on a
    terminal, lines in a pipe or a log."""
    from huggingface_hub import hf_hub_download

    from dsq import __version__
    from dsq.ui import console as stderr_console, progress_bar

    with progress_bar(console or stderr_console(), in_bytes=True) as bar:
        paths = []
        for f in files:
            tqdm_class = _bar_for(bar, f"downloading {rid.repo}/{f}")
            _resume_blob(rid.repo, f, revision, tqdm_class)
            paths.append(Path(hf_hub_download(rid.repo, f, revision=revision, library_name="dsq",
                                              library_version=__version__, tqdm_class=tqdm_class)))
        return paths


class _Flushed:
    """A file whose every write reaches the OS at once, so that a killed process leaves on disk
    every byte it received."""

    def __init__(self, f):
        self.f = f

    def write(self, data) -> int:
        n = self.f.write(data)
        self.f.flush()
        return n

    def __getattr__(self, name):
        return getattr(self.f, name)


def _resume_blob(repo: str, filename: str, revision: str | None, tqdm_class) -> None:
    """Fetch an LFS file (its ETag is its SHA-256) into the cache's blobs/<etag> through a partial
    blobs/<etag>.incomplete that outlives the process: a rerun after Ctrl-C, a kill or a dropped
    connection asks only for the bytes still missing (an HTTP Range request), then checks the
    whole file's SHA-256 (bytes that do not match are fetched again from the start).
    hf_hub_download then finds the blob and links it into the snapshot as its own.

    huggingface_hub itself writes each download to a file of its own process and deletes it on
    failure; files it fetches through hf_xet are left to it (xet's chunk cache keeps what arrived),
    and so are files that are not in LFS (small: config and tokenizer files)."""
    from huggingface_hub import constants, file_download, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import WeakFileLock, build_hf_headers
    from huggingface_hub.utils._runtime import is_xet_available

    from dsq import __version__

    url = hf_hub_url(repo, filename, revision=revision)
    headers = build_hf_headers(library_name="dsq", library_version=__version__)
    meta = get_hf_file_metadata(url, headers=headers)
    etag, size = meta.etag, meta.size
    if not etag or not _SHA256.fullmatch(etag) or size is None:
        return
    if meta.xet_file_data is not None and is_xet_available() and not constants.HF_HUB_DISABLE_XET:
        return
    folder = repo_folder_name(repo_id=repo, repo_type="model")
    blob = Path(constants.HF_HUB_CACHE) / folder / "blobs" / etag
    if blob.exists():
        return
    location = meta.location or url
    if urlsplit(location).netloc != urlsplit(url).netloc:  # a signed CDN address: no token for it
        headers.pop("authorization", None)
    part = blob.with_name(etag + ".incomplete")
    lock = Path(constants.HF_HUB_CACHE) / ".locks" / folder / f"{etag}.lock"
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):  # the lock huggingface_hub takes for this blob
        if blob.exists():
            return
        for _ in range(2):
            have = part.stat().st_size if part.exists() else 0
            if have > size:
                part.unlink()
                have = 0
            with part.open("r+b" if have else "wb") as f:
                f.seek(have)
                file_download.http_get(location, _Flushed(f), resume_size=have, headers=headers,
                                       expected_size=size, displayed_filename=filename, tqdm_class=tqdm_class)
            if not have or _sha256(part) == etag:
                break
            part.unlink()  # the kept bytes were not this file's: fetch it whole
        else:
            raise BadModelFile(f"{repo}/{filename} does not match its SHA-256 {etag} after a whole download",
                               "run again; if it persists, the Hub (or a proxy) serves damaged bytes")
        os.replace(part, blob)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _bar_for(bar, description: str):
    """A tqdm-like class for huggingface_hub to report one file's bytes into `bar` (dsq.ui's
    progress_bar): it builds one when the file's download starts."""

    class FileBar:
        def __init__(self, *_, total=None, initial=0, **__):
            self.n = initial or 0
            self.task = bar.add_task(description, total=total)
            bar.update(self.task, completed=self.n)

        def update(self, n=1) -> None:
            self.n += n or 0
            bar.update(self.task, completed=self.n)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def close(self) -> None:
            pass

        def refresh(self, *_, **__) -> None:
            pass

        def set_postfix_str(self, *_, **__) -> None:
            pass

    return FileBar


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def _listing(rid: RepoId, revision: str | None) -> list[str]:
    from huggingface_hub import HfApi

    info = HfApi().model_info(rid.repo, revision=revision)
    return [s.rfilename for s in info.siblings or []]


def _cached_listing(rid: RepoId, revision: str | None) -> tuple[Path, list[str]]:
    """The cache's snapshot of `rid` at `revision` (a branch or tag it was fetched by, or a commit)
    and the files it holds: each one whole (huggingface_hub links a file in only once complete)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=rid.repo, repo_type="model")
    rev = revision or "main"
    ref = storage / "refs" / rev
    folder = storage / "snapshots" / (ref.read_text().strip() if ref.is_file() else rev)
    if not folder.is_dir():
        raise ModelNotFound(f"{_OFFLINE_NOTE}, and it holds no {_at(rid.repo, revision)}",
                            f"unset HF_HUB_OFFLINE to download it (or `dsq pull {rid}` while online)")
    return folder, sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _check_shards(rid: RepoId, folder: Path) -> None:
    """Every safetensors shard the index names is there (a cached copy may lack some)."""
    import json

    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return
    shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise ModelNotFound(f"{rid.repo}: its safetensors index names {missing[0]}, which is not in the "
                            f"{'cached copy' if _offline() else 'repo'}",
                            "unset HF_HUB_OFFLINE and run again to finish its download" if _offline()
                            else "pick a revision whose files are complete (--revision)")


def pick_files(rid: RepoId, names: list[str]) -> tuple[str, list[str]]:
    """("hf" | "gguf", the repo files to fetch): a GGUF file (all parts of a split one; the first
    part first), or an HF model directory's safetensors, config and tokenizer files."""
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf"))
    if rid.file is not None:
        if rid.file not in names:
            raise ModelNotFound(f"{rid.repo} has no file {rid.file}",
                                f"its GGUF files: {', '.join(ggufs)}" if ggufs else "it has no GGUF files")
        return "gguf", _with_parts(rid.file, names)
    if rid.quant is not None:
        if not ggufs:
            raise BadModelFile(f"{rid.repo} has no GGUF files, so no quant {rid.quant}",
                               f"drop :{rid.quant} to fetch its HF model directory")
        tag = re.compile(rf"(?:^|[-._]){re.escape(rid.quant)}(?=[-.]|$)", re.IGNORECASE)  # Q4_K is not Q4_K_M
        hits = [g for g in ggufs if tag.search(PurePosixPath(g).name)]
        if not hits:
            raise ModelNotFound(f"{rid.repo} has no {rid.quant} GGUF",
                                f"it has: {', '.join(available_quants(ggufs)) or ', '.join(ggufs)}")
        return "gguf", _with_parts(hits[0], names)
    if "config.json" in names and any(n.endswith(".safetensors") and "/" not in n for n in names):
        return "hf", sorted(n for n in names if _HF_FILES.match(n))
    groups = {_SPLIT.sub(".gguf", g) for g in ggufs}
    if len(groups) == 1:
        return "gguf", _with_parts(ggufs[0], names)
    if ggufs:
        raise BadModelFile(f"{rid.repo} holds several GGUF files",
                           f"pick one: {rid.repo}:QUANT with QUANT one of "
                           f"{', '.join(available_quants(ggufs)) or ', '.join(ggufs)}")
    if any(n.endswith(_REFUSED_WEIGHTS) for n in names):
        raise BadModelFile(f"{rid.repo} has only pickled or non-safetensors weights (such as "
                           f"{next(n for n in names if n.endswith(_REFUSED_WEIGHTS))})",
                           "dsq loads safetensors or GGUF only: pick a repo of the model with *.safetensors")
    raise BadModelFile(f"{rid.repo} holds no model dsq can load (no config.json with *.safetensors, no .gguf)",
                       "pick a repo with an HF model directory or GGUF files")


def _with_parts(first: str, names: list[str]) -> list[str]:
    """A GGUF and, when it is one part of a split GGUF, all its parts (the first one first)."""
    m = _SPLIT.search(first)
    if m is None:
        return [first]
    n = int(m[2])
    parts = [first[: m.start()] + f"-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    absent = [p for p in parts if p not in names]
    if absent:
        raise BadModelFile(f"split GGUF {first} lacks its part {absent[0]} in the repo", "pick another quant or file")
    return parts


def _quants_of(name: str) -> set[str]:
    return {q.upper() for q in _QUANT.findall(PurePosixPath(name).name)}


def available_quants(ggufs: list[str]) -> list[str]:
    return sorted({q for g in ggufs for q in _quants_of(g)})


def _at(repo: str, revision: str | None) -> str:
    return f"cached copy of {repo}" + (f" at revision {revision}" if revision else "")


class _hub_errors:
    """huggingface_hub's exceptions as one-line DsqErrors that say what to do next."""

    def __init__(self, rid: RepoId, revision: str | None, offline: bool):
        self.rid, self.revision, self.offline = rid, revision, offline

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, DsqError):
            return False
        err = self.translate(e)
        if err is None:
            return False
        raise err from None

    def translate(self, e: BaseException) -> BaseException | None:
        from huggingface_hub import constants
        from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                            LocalEntryNotFoundError, OfflineModeIsEnabled,
                                            RepositoryNotFoundError, RevisionNotFoundError)

        repo, rev = self.rid.repo, self.revision
        if isinstance(e, KeyboardInterrupt):
            return KeyboardInterrupt(f"rerun to resume the download of {repo}: its finished files stay in the "
                                     "Hugging Face cache")
        if isinstance(e, GatedRepoError):
            return DsqError(f"{repo} is gated: the Hub refused the download"
                            + ("" if _has_token() else " (no token)"),
                            f"accept its terms at {constants.ENDPOINT}/{repo}, then set HF_TOKEN or run "
                            "`hf auth login`")
        if isinstance(e, RevisionNotFoundError):
            return ModelNotFound(f"{repo} has no revision {rev or 'main'}", "pass a branch, tag or commit it has "
                                 "to --revision")
        if isinstance(e, RepositoryNotFoundError):
            return RepoNotFound(repo, "" if _has_token() else " (or it is private and no token is set)")
        if isinstance(e, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
            if self.offline:
                return ModelNotFound(f"{_OFFLINE_NOTE}, and it has no complete {_at(repo, rev)}",
                                     f"unset HF_HUB_OFFLINE to download it (or `dsq pull {self.rid}` while online)")
            return HubUnreachable(f"cannot reach {constants.ENDPOINT} to fetch {repo}, and the Hugging Face cache "
                                  "has no complete copy", "check the network connection and run again")
        if isinstance(e, EntryNotFoundError):
            return ModelNotFound(f"{repo} changed while it was fetched: a file it listed is gone", "run again")
        if isinstance(e, HfHubHTTPError):
            return DsqError(f"the Hub answered {_status(e)} for {repo}", "run again later")
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return DiskFull(f"the disk filled while fetching {repo} into {constants.HF_HUB_CACHE}",
                            "free some space (or point HF_HOME at a larger disk) and run again: finished files are "
                            "kept")
        if _is_network_error(e):
            return HubUnreachable(f"the connection to {constants.ENDPOINT} failed while fetching {repo}: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}",
                            "check the network and run again: finished files are kept")
        return None


def _is_network_error(e: BaseException) -> bool:
    """A transport error of huggingface_hub's HTTP client (by name: which client it uses is its own
    affair), or its check that a file arrived whole."""
    return (any(c.__name__ in ("TransportError", "ConnectionError") for c in type(e).__mro__)
            or (isinstance(e, OSError) and "Consistency check failed" in str(e)))


def _status(e) -> str:
    r = getattr(e, "response", None)
    return f"HTTP {r.status_code}" if r is not None else str(e).splitlines()[0]


def _has_token() -> bool:
    from huggingface_hub import get_token

    return get_token() is not None


@dataclass(frozen=True)
class CachedRepo:
    repo: str
    revisions: list[str]  # "main (1a2b3c4d)": the branches and tags it was fetched by, and their commit
    bytes: int


def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cached_repos() -> list[CachedRepo]:
    """The model repos in the Hugging Face cache (what dsq, transformers and the rest fetched)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    if not hub_cache_dir().is_dir():
        return []
    try:
        info = scan_cache_dir(hub_cache_dir())  # (its default is the folder as it was when it was imported)
    except CacheNotFound:
        return []
    return [CachedRepo(r.repo_id, sorted(f"{'/'.join(sorted(v.refs)) or 'commit'} ({v.commit_hash[:8]})"
                                         for v in r.revisions), r.size_on_disk)
            for r in sorted(info.repos, key=lambda r: r.repo_id) if r.repo_type == "model"]


def remove_cached(repo: str) -> int:
    """Remove a model repo from the Hugging Face cache (every revision); returns the bytes freed."""
    from huggingface_hub import scan_cache_dir

    rid = parse_repo_id(repo)
    name = rid.repo if rid else repo
    found = [r for r in cached_repos() if r.repo == name]
    if not found:
        held = ", ".join(r.repo for r in cached_repos()) or "nothing"
        raise ModelNotFound(f"{name} is not in the Hugging Face cache ({hub_cache_dir()})", f"it holds: {held}")
    info = scan_cache_dir(hub_cache_dir())
    commits = [v.commit_hash for r in info.repos if r.repo_id == name and r.repo_type == "model" for v in r.revisions]
    strategy = info.delete_revisions(*commits)
    strategy.execute()
    return strategy.expected_freed_size
