"""What runs inside the test shoot for kube-apiserver to reach through the
tunnel (kube_apiserver_e2e.rs). Not a stand-in for anything seedlink talks
to: these are the shoot's workloads, and kube-apiserver (the real one) is
their client.

- APPS (HTTPS, the Service `shoot-apps`'s pod):
  - POST /validate: a validating admission webhook (AdmissionReview v1);
    denies objects whose name starts with "deny-", "denied by the shoot's
    webhook" (APPS_WHO in the environment names another owner, and
    APPS_GROUP another API group, the greeting "hello-from-<APPS_PLACE>":
    the same app serves as a webhook and an aggregated API in the seed).
  - GET /apis/demo.seedlink.test/v1[...]: an aggregated API.
  - GET /hello: the service proxy's target.
- KUBELET (HTTPS with client certificates, the node's address): the
  kubelet API paths kube-apiserver uses:
  - GET /containerLogs/NS/POD/CONTAINER[?follow=true]: the log (with
    follow, one line every 50 ms until the client goes);
  - GET /healthz, /hello: the node proxy's target;
  - POST /portForward/NS/POD, /exec/NS/POD/CONTAINER with an Upgrade
    header: 101, then an echo of every byte (kube-apiserver's own
    upgrade and streaming are what is tested, not SPDY framing).
  A real kubelet serves these paths in another test
  (a_real_kubelet_serves_logs_exec_and_port_forward_through_the_tunnel);
  this one streams on cue, for the failure cases.

usage: shoot_apps.py APPS_ADDR APPS_CERT APPS_KEY KUBELET_ADDR|none KUBELET_CERT KUBELET_KEY KUBELET_CLIENT_CA
Prints "up" when both listen.
"""

import http.server
import json
import os
import socketserver
import ssl
import sys
import threading
import time

(apps_addr, apps_cert, apps_key, kubelet_addr, kubelet_cert, kubelet_key,
 client_ca) = sys.argv[1:8]

GROUP = os.environ.get("APPS_GROUP", "demo.seedlink.test")
PLACE = os.environ.get("APPS_PLACE", "the-shoot")
WHO = os.environ.get("APPS_WHO", "the shoot's")


def split(addr):
    host, port = addr.rsplit(":", 1)
    return host.strip("[]"), int(port)


class Base(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, code, body, ctype="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class Apps(Base):
    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/hello" or path.endswith("/hello"):
            return self.answer(200, b"hello from the shoot's service\n", "text/plain")
        if path == f"/apis/{GROUP}/v1":
            return self.answer(200, {
                "kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{GROUP}/v1",
                "resources": [{"name": "greetings", "singularName": "greeting",
                               "namespaced": False, "kind": "Greeting",
                               "verbs": ["get", "list"]}]})
        if path == f"/apis/{GROUP}/v1/greetings":
            return self.answer(200, {
                "kind": "GreetingList", "apiVersion": f"{GROUP}/v1",
                "metadata": {},
                "items": [{"kind": "Greeting", "apiVersion": f"{GROUP}/v1",
                           "metadata": {"name": f"hello-from-{PLACE}"}}]})
        if path in ("/apis", f"/apis/{GROUP}"):
            return self.answer(200, {
                "kind": "APIGroup", "apiVersion": "v1", "name": GROUP,
                "versions": [{"groupVersion": f"{GROUP}/v1", "version": "v1"}],
                "preferredVersion": {"groupVersion": f"{GROUP}/v1", "version": "v1"}})
        return self.answer(404, {"kind": "Status", "apiVersion": "v1",
                                 "status": "Failure", "code": 404})

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        review = json.loads(self.rfile.read(n) or b"{}")
        req = review.get("request", {})
        name = req.get("name") or req.get("object", {}).get("metadata", {}).get("name", "")
        allowed = not name.startswith("deny-")
        resp = {"uid": req.get("uid", ""), "allowed": allowed}
        if not allowed:
            resp["status"] = {"code": 403, "message": f"denied by {WHO} webhook"}
        return self.answer(200, {"apiVersion": "admission.k8s.io/v1",
                                 "kind": "AdmissionReview", "response": resp})


class Kubelet(Base):
    def do_GET(self):
        path = self.path.split("?")[0]
        if path.startswith("/containerLogs/"):
            if "follow=true" not in self.path:
                return self.answer(200, b"log line from the shoot's kubelet\n", "text/plain")
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for i in range(100000):
                    line = f"follow {i}\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass
            self.close_connection = True
            return
        if path in ("/healthz", "/hello"):
            return self.answer(200, b"hello from the shoot's kubelet\n", "text/plain")
        return self.answer(404, b"not found\n", "text/plain")

    def do_POST(self):
        path = self.path.split("?")[0]
        if not (path.startswith("/portForward/") or path.startswith("/exec/")):
            return self.answer(404, b"not found\n", "text/plain")
        upgrade = self.headers.get("Upgrade", "")
        if not upgrade:
            return self.answer(400, b"upgrade required\n", "text/plain")
        self.wfile.write(("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                          f"Upgrade: {upgrade}\r\n\r\n").encode())
        self.wfile.flush()
        conn = self.connection
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    break
                conn.sendall(data)
        except OSError:
            pass
        self.close_connection = True


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(addr, handler, cert, key, ca=None):
    srv = Server(split(addr), handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    if ca:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(ca)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


serve(apps_addr, Apps, apps_cert, apps_key)
if kubelet_addr != "none":  # "none": a real kubelet serves the node
    serve(kubelet_addr, Kubelet, kubelet_cert, kubelet_key, client_ca)
print("up", flush=True)
threading.Event().wait()
