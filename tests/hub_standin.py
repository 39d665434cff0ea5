"""A Hugging Face Hub stand-in: a real HTTP server on 127.0.0.1 answering what huggingface_hub
calls to list and download a model repo (HF_ENDPOINT points it here):

  GET  /api/models/{repo}[/revision/{rev}]   model info: sha, siblings, gated
  GET  /api/models/{repo}/tree/{rev}         the file listing (size, oid, lfs)
  HEAD /{repo}/resolve/{rev}/{file}          X-Repo-Commit, ETag / X-Linked-Etag, sizes
  GET  /{repo}/resolve/{rev}/{file}          the bytes; a Range request gets 206 from its offset

Errors carry the Hub's X-Error-Code headers (RepoNotFound, RevisionNotFound, EntryNotFound,
GatedRepo), which huggingface_hub turns into its exceptions. `cut_after(file, n)` makes the next
GET of that file stop after n bytes and drop the connection, once; `stall_after(file, n)` makes it
send n bytes and then nothing until `release()`. `served` logs each GET's (file, offset, bytes
sent). No xet: files are plain HTTP.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_LFS = (".safetensors", ".gguf", ".bin")  # stored in git-lfs on the Hub: ETag is the sha256


def _sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> files
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> sha
    gated: bool = False

    def add(self, files: dict[str, bytes], ref: str = "main") -> str:
        sha = _sha(f"{ref}:{sorted(files)}:{len(self.commits)}")
        self.commits[sha], self.refs[ref] = files, sha
        return sha

    def commit(self, rev: str) -> str | None:
        return rev if rev in self.commits else self.refs.get(rev)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _etag(name: str, data: bytes) -> str:
    if name.endswith(_LFS):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubStandin:
    """The server, its repos (repo id -> Repo), the token gated repos accept, and a log of requests."""

    def __init__(self, token: str = "hf_standin_token"):
        self.repos: dict[str, Repo] = {}
        self.token = token
        self.log: list[tuple[str, str, dict[str, str]]] = []
        self._cuts: dict[str, int] = {}
        self._stalls: dict[str, int] = {}
        self._released = threading.Event()
        self.served: list[tuple[str, int, int]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def repo(self, repo_id: str, gated: bool = False) -> Repo:
        self.repos[repo_id] = Repo(gated=gated)
        return self.repos[repo_id]

    def cut_after(self, filename: str, n: int) -> None:
        self._cuts[filename] = n

    def stall_after(self, filename: str, n: int) -> None:
        self._stalls[filename] = n

    def release(self) -> None:
        self._released.set()

    def gets(self, filename: str) -> list[dict[str, str]]:
        """The headers (names in lower case) of each GET of a file (whatever repo or revision)."""
        return [h for m, p, h in self.log if m == "GET" and "/resolve/" in p and p.endswith("/" + filename)]

    def __enter__(self) -> "HubStandin":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._released.set()
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._route(body=False)

            def do_GET(self) -> None:
                self._route(body=True)

            def _route(self, body: bool) -> None:
                hub.log.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
                path = unquote(urlsplit(self.path).path)
                if path.startswith("/api/models/"):
                    return self._api(path.removeprefix("/api/models/"))
                if "/resolve/" in path:
                    repo_id, rest = path.lstrip("/").split("/resolve/", 1)
                    rev, _, name = rest.partition("/")
                    return self._file(repo_id, rev, name, body)
                self._error(404, "NotFound", "no such route")

            def _find(self, repo_id: str, rev: str):
                repo = hub.repos.get(repo_id)
                if repo is None:  # the Hub answers 401 to an anonymous look-up of a missing repo
                    return self._error(401, "RepoNotFound", "Repository not found"), None
                sha = repo.commit(rev)
                if sha is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}"), None
                return repo, sha

            def _api(self, rest: str) -> None:
                parts = rest.split("/")
                repo_id, tail = "/".join(parts[:2]), parts[2:]
                if tail and tail[0] == "tree":
                    repo, sha = self._find(repo_id, tail[1])
                    if repo is None:
                        return
                    entries = []
                    for name, data in repo.commits[sha].items():
                        e = {"type": "file", "path": name, "size": len(data), "oid": _etag(name + ".git", data)}
                        if name.endswith(_LFS):
                            e["lfs"] = {"oid": _etag(name, data), "size": len(data), "pointerSize": 134}
                        entries.append(e)
                    return self._json(entries)
                rev = tail[1] if len(tail) == 2 and tail[0] == "revision" else "main"
                repo, sha = self._find(repo_id, rev)
                if repo is None:
                    return
                self._json({"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                            "gated": "auto" if repo.gated else False, "tags": [],
                            "siblings": [{"rfilename": n} for n in repo.commits[sha]]})

            def _file(self, repo_id: str, rev: str, name: str, body: bool) -> None:
                repo, sha = self._find(repo_id, rev)
                if repo is None:
                    return
                if repo.gated and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have "
                                       "access to it and be authenticated to access it. Please log in.")
                data = repo.commits[sha].get(name)
                if data is None:
                    return self._error(404, "EntryNotFound", f"{name} does not exist on {rev}")
                etag = f'"{_etag(name, data)}"'
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes=") and body:
                    start = int(rng[len("bytes="):].split("-")[0])
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", sha)
                self.send_header("ETag", etag)
                if name.endswith(_LFS):
                    self.send_header("X-Linked-Etag", etag)
                    self.send_header("X-Linked-Size", str(len(data)))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if not body:
                    return
                stall = hub._stalls.pop(name, None)
                cut = hub._cuts.pop(name, None) if stall is None else stall
                if cut is not None:
                    self.wfile.write(data[start:start + cut])
                    self.wfile.flush()
                    hub.served.append((name, start, len(data[start:start + cut])))
                    if stall is not None:
                        hub._released.wait(60)
                    self.close_connection = True
                    return
                self.wfile.write(data[start:])
                hub.served.append((name, start, len(data) - start))

            def _json(self, obj) -> None:
                raw = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _error(self, status: int, code: str, message: str) -> None:
                raw = json.dumps({"error": message}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(raw)

        return Handler
