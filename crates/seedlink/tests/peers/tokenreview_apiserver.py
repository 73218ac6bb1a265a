"""A stand-in for kube-apiserver's TokenReview endpoint (no API server
binary can be installed here). It serves HTTPS, requires the reviewer's own
bearer token, and answers POST /apis/authentication.k8s.io/v1/tokenreviews
from a table: token -> {"username": ..., "audiences": [...]} (authenticated),
or "error:<code>" (that HTTP status). Unknown tokens are not authenticated.
Every review appends the token to a log file, one per line.

usage: tokenreview_apiserver.py PORT CERT KEY CALLER_TOKEN TABLE_JSON LOG
"""

import http.server
import json
import ssl
import sys

port, cert, key, caller, table_path, log_path = sys.argv[1:7]
with open(table_path) as f:
    table = json.load(f)

PATH = "/apis/authentication.k8s.io/v1/tokenreviews"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(n)
        if self.path != PATH:
            return self.answer(404, {"kind": "Status", "message": "not found"})
        if self.headers.get("Authorization") != "Bearer " + caller:
            return self.answer(401, {"kind": "Status", "message": "Unauthorized"})
        review = json.loads(raw)
        token = review["spec"]["token"]
        with open(log_path, "a") as f:
            f.write(token + "\n")
        entry = table.get(token)
        if isinstance(entry, str) and entry.startswith("error:"):
            code = int(entry.split(":", 1)[1])
            return self.answer(code, {"kind": "Status", "message": "induced failure"})
        status = {"authenticated": False, "error": "invalid bearer token"}
        if entry is not None:
            wanted = review["spec"].get("audiences") or []
            common = [a for a in entry["audiences"] if a in wanted]
            if common:
                status = {
                    "authenticated": True,
                    "user": {"username": entry["username"]},
                    "audiences": common,
                }
            else:
                status = {"authenticated": False, "error": "token audiences invalid"}
        review["status"] = status
        self.answer(201, review)


server = http.server.ThreadingHTTPServer(("127.0.0.1", int(port)), Handler)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
server.socket = ctx.wrap_socket(server.socket, server_side=True)
print("up", flush=True)
server.serve_forever()
