"""A local server that answers the Hugging Face Hub's endpoints as huggingface_hub calls them (HF_ENDPOINT=its url):
repository info (`/api/models/<repo>/revision/<rev>`), the file listing (`.../tree/<rev>`), file metadata and
downloads (`/<repo>/resolve/<rev>/<file>`, HEAD and GET, byte ranges), gated repositories (401 with
X-Error-Code: GatedRepo unless the request carries the token), unknown repositories (404 RepoNotFound). Every
file download is logged as (file, Range header or None)."""
from __future__ import annotations

import hashlib
import json
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote

from wmt_fixtures import LocalServer


class HubServer(LocalServer):
    def __init__(self, repos: dict[str, dict[str, bytes]], gated: dict[str, str] | None = None):
        """repos: repository -> {file name: bytes}; gated: repository -> the token that opens it."""
        self.repos, self.gated, self.requests, self.cut_once = repos, gated or {}, [], set()
        self.commits = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in repos}
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, code: int, headers: dict, body: bytes = b"") -> None:
                self.send_response(code)
                for key, value in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(key, value)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _error(self, code: int, error: str) -> None:
                self._send(code, {"X-Error-Code": error, "X-Error-Message": error, "Content-Type": "application/json"},
                           json.dumps({"error": error}).encode())

            def _route(self):
                path = unquote(self.path.split("?")[0]).lstrip("/")
                if path.startswith("api/models/"):
                    rest = path[len("api/models/"):]
                    if "/tree/" in rest:  # the file listing snapshot_download asks for
                        repo, _, revision = rest.partition("/tree/")
                        return "tree", repo, revision.split("/")[0], None
                    repo, _, revision = rest.partition("/revision/")
                    return "info", repo, revision, None
                repo_and_rest = path.split("/resolve/", 1)
                if len(repo_and_rest) == 2:
                    revision, _, name = repo_and_rest[1].partition("/")
                    return "file", repo_and_rest[0], revision, name
                return None, None, None, None

            def do_HEAD(self):
                self.do_GET()

            def do_GET(self):
                kind, repo, revision, name = self._route()
                if repo not in server.repos:
                    return self._error(404, "RepoNotFound")
                if revision not in ("main", server.commits[repo]):
                    return self._error(404, "RevisionNotFound")
                commit, files = server.commits[repo], server.repos[repo]
                if kind == "info":
                    body = {"id": repo, "modelId": repo, "sha": commit, "private": False,
                            "gated": "manual" if repo in server.gated else False,
                            "siblings": [{"rfilename": n} for n in sorted(files)]}
                    return self._send(200, {"Content-Type": "application/json"}, json.dumps(body).encode())
                if kind == "tree":
                    body = [{"type": "file", "oid": hashlib.sha256(data).hexdigest(), "size": len(data), "path": n}
                            for n, data in sorted(files.items())]
                    return self._send(200, {"Content-Type": "application/json"}, json.dumps(body).encode())
                token = server.gated.get(repo)
                if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
                    return self._error(401, "GatedRepo")
                if name not in files:
                    return self._error(404, "EntryNotFound")
                if self.command == "GET":
                    server.requests.append((name, self.headers.get("Range")))
                body = files[name]
                headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(body).hexdigest()}"',
                           "Accept-Ranges": "bytes"}
                ranged = self.headers.get("Range")
                if self.command == "GET" and ranged:
                    start = int(ranged.split("=")[1].split("-")[0])
                    headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
                    return self._send(206, headers, body[start:])
                if self.command == "GET" and name in server.cut_once:  # half the file, then the connection drops
                    server.cut_once.discard(name)
                    self.send_response(200)
                    for key, value in {**headers, "Content-Length": str(len(body))}.items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self._send(200, headers, body)

        self.serve(Handler)
