"""A stand-in Hub on 127.0.0.1 for the publish tests: the same HTTP calls huggingface_hub's create_repo and
upload_folder make to huggingface.co (repo creation, README metadata validation, preupload, the NDJSON
commit), answered by a small server that keeps what it receives. It answers every file as a "regular"
upload (base64 inside the commit), so no LFS or Xet storage is involved; the real Hub stores large files
through LFS/Xet, which this does not exercise."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from helpers import run_pipeline

TOKEN = "hf_standin_secret_0123456789"


class StandInHub(BaseHTTPRequestHandler):
    received: dict  # set on the subclass per server

    def log_message(self, *args):
        pass

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.received["auth"].add(self.headers.get("Authorization"))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._answer(401, {"error": "Invalid credentials in Authorization header"})
        if self.path == "/api/repos/create":
            self.received["created"].append(json.loads(body))
            repo = json.loads(body)
            return self._answer(200, {"url": f"{self.received['base']}/{repo['organization']}/{repo['name']}"})
        if self.path == "/api/validate-yaml":
            return self._answer(200, {})
        if "/preupload/" in self.path:
            files = json.loads(body)["files"]
            return self._answer(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                for f in files]})
        if "/commit/" in self.path:
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "header":
                    self.received["message"] = item["value"]["summary"]
                elif item["key"] == "file":
                    self.received["files"][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            repo = self.path.split("/api/models/", 1)[1].split("/commit/", 1)[0]
            return self._answer(200, {"commitUrl": f"{self.received['base']}/{repo}/commit/abc123", "commitOid": "abc123"})
        return self._answer(404, {"error": f"no route {self.path}"})


@pytest.fixture
def hub():
    received = {"auth": set(), "created": [], "files": {}, "message": None}
    handler = type("Handler", (StandInHub,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    received["base"] = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield received["base"], received
    server.shutdown()


def publish(root, endpoint, *extra, token=TOKEN, check=True):
    env = {"HF_ENDPOINT": endpoint, "HF_TOKEN": token, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}
    return run_pipeline("publish", "--model", "tiny", "--path", "native", "--repo", "team/tiny-sft", *extra, root=root,
                        check=check, env=env)
