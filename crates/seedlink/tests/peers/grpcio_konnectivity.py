"""Konnectivity peers built on Google's grpcio and protoc-generated code
from crates/tunnel/proto/konnectivity.proto, to check seedlink's wire format
against an independent gRPC stack.

  grpcio_konnectivity.py client UDS_PATH ADDRESS
      ProxyService/Proxy over a Unix socket, like kube-apiserver's
      konnectivity-client: DIAL_REQ, echo one message, CLOSE_REQ.
      Prints "OK <connectID>".
  grpcio_konnectivity.py tls-client HOST:PORT SERVER_NAME CA CERT KEY ADDRESS
      The same over TCP with mutual TLS.
  grpcio_konnectivity.py agent SERVER SERVER_NAME CA CERT KEY
      AgentService/Connect with TLS and a client certificate, like
      proxy-agent: checks the serverid/servercount headers, answers
      DIAL_REQ by dialing, relays DATA, answers CLOSE_REQ. Prints
      "connected <serverid> <servercount>" and runs until killed.
"""
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading

from grpc_tools import protoc

PROTO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tunnel", "proto")
OUT = tempfile.mkdtemp(prefix="konn-py-")
rc = protoc.main(["protoc", "-I" + PROTO_DIR, "--python_out=" + OUT, "--grpc_python_out=" + OUT, "konnectivity.proto"])
if rc != 0:
    sys.exit("protoc failed")
sys.path.insert(0, OUT)
import grpc  # noqa: E402
import konnectivity_pb2 as pb  # noqa: E402
import konnectivity_pb2_grpc as pbg  # noqa: E402


def client(uds, address, ch=None):
    ch = ch or grpc.insecure_channel("unix://" + uds)
    stub = pbg.ProxyServiceStub(ch)
    out = queue.Queue()
    out.put(pb.Packet(type=pb.DIAL_REQ, dialRequest=pb.DialRequest(protocol="tcp", address=address, random=77)))

    def gen():
        while True:
            p = out.get()
            if p is None:
                return
            yield p

    it = stub.Proxy(gen(), timeout=20)
    rsp = next(it)
    assert rsp.type == pb.DIAL_RSP, rsp
    assert rsp.dialResponse.random == 77 and rsp.dialResponse.error == "", rsp
    cid = rsp.dialResponse.connectID
    out.put(pb.Packet(type=pb.DATA, data=pb.Data(connectID=cid, data=b"ping from grpcio")))
    got = b""
    while len(got) < 16:
        p = next(it)
        assert p.type == pb.DATA and p.data.connectID == cid, p
        got += p.data.data
    assert got == b"ping from grpcio", got
    out.put(pb.Packet(type=pb.CLOSE_REQ, closeRequest=pb.CloseRequest(connectID=cid)))
    p = next(it)
    assert p.type == pb.CLOSE_RSP and p.closeResponse.connectID == cid, p
    out.put(None)
    print("OK", cid, flush=True)


def agent(server, name, ca, cert, key):
    creds = grpc.ssl_channel_credentials(open(ca, "rb").read(), open(key, "rb").read(), open(cert, "rb").read())
    ch = grpc.secure_channel(server, creds, options=[("grpc.ssl_target_name_override", name)])
    stub = pbg.AgentServiceStub(ch)
    out = queue.Queue()
    conns = {}
    next_id = [1]

    def gen():
        while True:
            yield out.get()

    call = stub.Connect(gen(), metadata=[("agentid", "grpcio-agent")])
    md = dict(call.initial_metadata())
    print("connected", md["serverid"], md["servercount"], flush=True)

    def pump(cid, s):
        while True:
            d = s.recv(4096)
            if not d:
                break
            out.put(pb.Packet(type=pb.DATA, data=pb.Data(connectID=cid, data=d)))
        if conns.pop(cid, None) is not None:
            out.put(pb.Packet(type=pb.CLOSE_RSP, closeResponse=pb.CloseResponse(connectID=cid)))

    for p in call:
        if p.type == pb.DIAL_REQ:
            host, port = p.dialRequest.address.rsplit(":", 1)
            try:
                s = socket.create_connection((host, int(port)), timeout=5)
            except OSError as e:
                out.put(pb.Packet(type=pb.DIAL_RSP, dialResponse=pb.DialResponse(random=p.dialRequest.random, error=str(e))))
                continue
            cid = next_id[0]
            next_id[0] += 1
            conns[cid] = s
            out.put(pb.Packet(type=pb.DIAL_RSP, dialResponse=pb.DialResponse(random=p.dialRequest.random, connectID=cid)))
            threading.Thread(target=pump, args=(cid, s), daemon=True).start()
        elif p.type == pb.DATA:
            s = conns.get(p.data.connectID)
            if s is not None:
                s.sendall(p.data.data)
        elif p.type == pb.CLOSE_REQ:
            s = conns.pop(p.closeRequest.connectID, None)
            if s is not None:
                s.close()
            out.put(pb.Packet(type=pb.CLOSE_RSP, closeResponse=pb.CloseResponse(connectID=p.closeRequest.connectID)))


def tls_client(target, name, ca, cert, key, address):
    creds = grpc.ssl_channel_credentials(open(ca, "rb").read(), open(key, "rb").read(), open(cert, "rb").read())
    ch = grpc.secure_channel(target, creds, options=[("grpc.ssl_target_name_override", name)])
    client(None, address, ch)


if __name__ == "__main__":
    if sys.argv[1] == "client":
        client(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "tls-client":
        tls_client(*sys.argv[2:8])
    else:
        agent(*sys.argv[2:7])
