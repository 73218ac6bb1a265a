# Half-open connections against a gateway: N connections that send nothing
# or only part of a head (ClientHello, CONNECT head, PROXY v1 header), RSS
# per connection above the baseline before them, loopback only.
# Usage: MODE=<silent|clienthello-trickle|connect-trickle|proxy-trickle|h2-streamless> \
#        [ROUNDS=2] [SETTLE=30] scripts/half-open-rss.py target/release/seedlink 2000
# (one mode per process: freed memory of an earlier mode would be reused).
# Prints KiB per connection (the first round), and the RSS (KiB) before the
# first round, at each round's peak, and SETTLE seconds after the last
# round's connections closed (is the memory given back?).
import os, socket, subprocess, sys, time, json, tempfile
bin_, n = sys.argv[1], int(sys.argv[2])
d = tempfile.mkdtemp()
cfg = os.path.join(d, "gw.yaml")
open(cfg, "w").write("""admin: {listen: '127.0.0.1:0'}
listeners:
  - {name: auto, address: '127.0.0.1:0', protocol: auto}
  - {name: lb, address: '127.0.0.1:0', protocol: tls, proxy_protocol: required}
trusted_load_balancers: [127.0.0.0/8]
timeouts: {client_hello: 60s}
control_planes:
  - {name: a, hostnames: [api.a.example.com], endpoints: ['127.0.0.1:9'], destinations: [{name: 'outbound|443||kube-apiserver.a.svc.cluster.local'}]}
""")
p = subprocess.Popen([bin_, "gateway", "--config", cfg], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
ready = json.loads(p.stdout.readline())
ls = ready["listeners"]
def addr(name):
    v = ls[name] if isinstance(ls, dict) else [x for x in ls if x["name"] == name][0]["address"]
    h, pt = v.rsplit(":", 1); return (h, int(pt))
def rss():
    for l in open(f"/proc/{p.pid}/status"):
        if l.startswith("VmRSS"): return int(l.split()[1])
hello = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "proto", "testdata", "openssl_client_hello.bin"), "rb").read()
modes = {
  "silent": (addr("auto"), b""),
  "clienthello-trickle": (addr("auto"), hello[:40]),
  "connect-trickle": (addr("auto"), b"CONNECT x:443 HTTP/1.1\r\nX-Gard"),
  "proxy-trickle": (addr("lb"), b"PROXY TCP4 10.0.0.1 10.0.0.2 1 2"),
  # HTTP/2 with prior knowledge: the preface and an empty SETTINGS frame,
  # then never a stream (the gateway closes it at the detection deadline).
  "h2-streamless": (addr("auto"), b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])),
}
time.sleep(0.5)
out = {}
only = os.environ.get("MODE")
rounds = int(os.environ.get("ROUNDS", "1"))
settle = float(os.environ.get("SETTLE", "1"))
out["rss_baseline_kib"] = rss()
for mode, (a, first) in modes.items():
    if only and mode != only: continue
    for r in range(rounds):
        base = rss(); socks = []
        for i in range(n):
            s = socket.create_connection(a)
            if first: s.sendall(first)
            socks.append(s)
        time.sleep(1.0)
        peak = rss()
        # Every connection still held by the gateway (not refused early).
        out.setdefault("fds_at_peak", []).append(len(os.listdir(f"/proc/{p.pid}/fd")))
        if r == 0: out[mode] = round((peak - base) / n, 2)
        out.setdefault("rss_peak_kib", []).append(peak)
        for s in socks: s.close()
        time.sleep(1.0)
    t0 = time.time()
    while time.time() - t0 < settle: time.sleep(1.0)
    out["rss_after_%gs_kib" % settle] = rss()
print(json.dumps(out))
p.kill()
