"""A Hugging Face-shaped file server on 127.0.0.1 for the pull tests (the hub itself is not
reachable from the test machines). It serves ROOT/ORG/REPO/FILE the way the hub does:

  GET /api/models/ORG/REPO/tree/main   the file list, each GGUF with its size and SHA-256
                                       (`lfs.oid`), as the hub's API gives them
  GET /ORG/REPO/resolve/main/FILE      the file, with `Range: bytes=N-` answered 206

A file FILE.sha256 beside FILE replaces the published hash (a hub that lists another file's
hash: the client must refuse the download). A file FILE.shift holding N makes a ranged request
for bytes=S- answer from S+N, saying so in Content-Range (a resume that does not continue where
it was asked to: the client must not splice it on). With --cut N, the first whole-file transfer of each
file stops after N bytes and the connection closes: an interrupted download to resume.
Every request is appended to ROOT/requests.log (method, path, Range header).

usage: hf_server.py ROOT PORT_FILE [--cut N]
"""

import hashlib
import http.server
import json
import os
import sys
import threading

ROOT = sys.argv[1]
PORT_FILE = sys.argv[2]
CUT = int(sys.argv[sys.argv.index("--cut") + 1]) if "--cut" in sys.argv else None
cut_done = set()
lock = threading.Lock()


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Hub(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send_json(self, status, value):
        body = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        with lock, open(os.path.join(ROOT, "requests.log"), "a") as log:
            log.write(f"GET {self.path} range={self.headers.get('Range')}\n")
        parts = self.path.split("?")[0].strip("/").split("/")
        if len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4:] == ["tree", "main"]:
            repo = os.path.join(ROOT, parts[2], parts[3])
            if not os.path.isdir(repo):
                return self.send_json(404, {"error": "Repository not found"})
            listing = []
            for name in sorted(os.listdir(repo)):
                path = os.path.join(repo, name)
                if name.endswith(".sha256") or name.endswith(".shift"):
                    continue
                size = os.path.getsize(path)
                entry = {"type": "file", "oid": "0" * 40, "size": size, "path": name}
                if name.endswith(".gguf"):
                    published = path + ".sha256"
                    oid = open(published).read().strip() if os.path.exists(published) else sha256(path)
                    entry["lfs"] = {"oid": oid, "size": size, "pointerSize": 135}
                listing.append(entry)
            return self.send_json(200, listing)
        if len(parts) == 5 and parts[2:4] == ["resolve", "main"]:
            path = os.path.join(ROOT, parts[0], parts[1], parts[4])
            if not os.path.isfile(path):
                return self.send_json(404, {"error": "Entry not found"})
            size = os.path.getsize(path)
            start = 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and rng.endswith("-"):
                start = int(rng[6:-1])
                if os.path.exists(path + ".shift"):
                    start += int(open(path + ".shift").read())
                if start >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            else:
                self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size - start))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            limit = None
            with lock:
                if CUT is not None and start == 0 and path not in cut_done:
                    cut_done.add(path)
                    limit = CUT
            with open(path, "rb") as f:
                f.seek(start)
                sent = 0
                while True:
                    block = f.read(1 << 20)
                    if not block:
                        break
                    if limit is not None and sent + len(block) > limit:
                        self.wfile.write(block[: limit - sent])
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    self.wfile.write(block)
                    sent += len(block)
            return
        self.send_json(404, {"error": "not found"})


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
with open(PORT_FILE + ".tmp", "w") as f:
    f.write(str(server.server_address[1]))
os.rename(PORT_FILE + ".tmp", PORT_FILE)
server.serve_forever()
