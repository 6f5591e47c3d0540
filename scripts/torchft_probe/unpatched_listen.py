"""What torchft 0.2.0 listens on WITHOUT ftloop's patches (plain Manager + default HTTPTransport)."""
import os, sys, socket
from datetime import timedelta
import torch
torch.set_num_threads(1)
import torch.distributed as dist
from torchft import Manager, ProcessGroupGloo
from torchft._torchft import LighthouseServer
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
addr = "http://127.0.0.1:" + lh.address().rsplit(":", 1)[1]
before = None
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(8); port = s.getsockname()[1]
store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10), wait_for_workers=False,
                      master_listen_fd=s.detach(), use_libuv=True)
from ftloop_listen import listening_sockets
pre = set(listening_sockets(os.getpid()))
m = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), load_state_dict=lambda s: None,
            state_dict=lambda: {}, min_replica_size=1, store_addr="127.0.0.1", store_port=port,
            rank=0, world_size=1, lighthouse_addr=addr, replica_id="r0")
m.start_quorum(); m.wait_quorum()
print("lighthouse + our store:", sorted(pre))
print("added by Manager (ManagerServer, HTTPTransport, Gloo):", sorted(set(listening_sockets(os.getpid())) - pre))
print("advertised ManagerServer address:", m._store.get("manager_addr").decode(),
      "| checkpoint metadata:", m._checkpoint_transport.metadata())
m.shutdown(wait=False); lh.shutdown(); os._exit(0)
